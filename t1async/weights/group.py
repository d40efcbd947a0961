"""The weight group: one standalone torch.distributed process group per learner and its samplers.

Every member runs the same recipe (:func:`join_group`; SGLang's ``init_custom_process_group``):
``torch.distributed.rendezvous("tcp://ADDR:PORT", rank, world)`` (rank 0 hosts the TCPStore),
``PrefixStore(group_name, store)``, then torch's process-group helper. The group is never the
default one a Megatron learner uses. Backends: gloo (CPU) and nccl (GPUs, one rank per GPU).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from loguru import logger

from t1async.weights.protocol import WeightSyncError

GROUP_NAME = "t1async-weights"


def join_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str, timeout_s: float) -> "WeightGroup":
    """Join a standalone broadcast group so that it meets members built by SGLang's recipe.

    SGLang (``init_custom_process_group``): ``tcp://`` rendezvous (rank 0 hosts the TCPStore at
    ``master_port``), ``PrefixStore(group_name, store)``, then torch's ``_new_process_group_helper``,
    which prefixes ``group_name/`` again, builds one backend under the first device's prefix
    (gloo: ``cpu/``, serving cuda tensors too; nccl: ``cuda/``) and agrees a sequence number
    through the store (``_set_sequence_number_for_group``). This function builds that same
    backend on those same store keys, but without registering a process group by name in torch's
    process-wide table, so several members (an embedded sampler and the learner in one test
    process, or a re-join after a learner restart) can live in one process.
    tests/contracts/test_sglang_backends.py checks that it meets members built with the helper itself.

    Returns:
        A :class:`WeightGroup` (``broadcast(tensor, root)``, ``close()``).

    Raises:
        WeightSyncError: unknown backend.
        RuntimeError / DistStoreError: rendezvous failed within ``timeout_s``.
    """
    if backend not in ("gloo", "nccl"):
        raise WeightSyncError(f"weight_sync.backend {backend!r} is not supported: use 'gloo' (CPU) or 'nccl' (GPUs)")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    group_store = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", group_store), rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", group_store), rank, world_size, opts)
    pg._set_sequence_number_for_group()
    return WeightGroup(pg, store)


class WeightGroup:
    """One member's backend of a weight group (see :func:`join_group`).

    ``broadcast(tensor, root)`` returns the work handle (``.wait()``); ``store`` is kept alive with
    the group (rank 0 hosts it).
    """

    def __init__(self, pg, store) -> None:
        self._pg, self.store = pg, store

    def broadcast(self, tensor: torch.Tensor, root: int):
        """Broadcast ``tensor`` in place from ``root``; returns the work handle."""
        return self._pg.broadcast(tensor, root)

    def close(self) -> None:
        """Shut the backend down (errors of a group broken by a timeout are ignored)."""
        try:
            if hasattr(self._pg, "shutdown"):
                self._pg.shutdown()
        except Exception as e:
            logger.debug("shutting down a weight group backend: {}", e)


def leave_group(group: WeightGroup) -> None:
    """Leave a group made by :func:`join_group`."""
    group.close()
