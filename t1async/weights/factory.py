"""The learner's weight sync for a ``WeightSyncConfig``."""

from __future__ import annotations

from typing import Any

from t1async.weights.distributed import DistributedWeightSync
from t1async.weights.protocol import MODES, WeightSyncError
from t1async.weights.tensor import TensorWeightSync


def make_weight_sync(cfg: Any) -> DistributedWeightSync | TensorWeightSync:
    """The learner's side for a ``WeightSyncConfig`` (``mode``, ``backend``, ``master_address``,
    ``master_port``, ``timeout_s``, ``bucket_mb``, ``pause_mode``).

    Raises:
        WeightSyncError: an unknown ``mode``.
    """
    if cfg.mode == "tensor":
        return TensorWeightSync(cfg.timeout_s, bucket_mb=cfg.bucket_mb, pause_mode=cfg.pause_mode)
    if cfg.mode == "distributed":
        return DistributedWeightSync(cfg.backend, cfg.master_address, cfg.master_port, cfg.timeout_s,
                                     bucket_mb=cfg.bucket_mb, pause_mode=cfg.pause_mode)
    raise WeightSyncError(f"weight_sync.mode {cfg.mode!r} is not supported: use one of {MODES}")
