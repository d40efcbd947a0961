"""Weight sync: the learner (rank 0) broadcasts every parameter to all samplers with torch.distributed.

The protocol is SGLang's: the learner asks each sampler over HTTP to join a process group
(``POST /init_weights_update_group``), then, for each update, asks every sampler to receive
(``POST /update_weights_from_distributed`` with names, dtypes, shapes and the new
``weight_version``) while it broadcasts the tensors in that order. Samplers receive into
staging buffers and swap the weights in between requests. The group is a standalone
ProcessGroupGloo (CPU) or ProcessGroupNCCL (GPUs) over its own TCPStore, so it never touches the
default process group a Megatron learner uses.

Source: SGLang ``UpdateWeightsFromDistributedReqInput`` / ``InitWeightsUpdateGroupReqInput``;
torch.distributed ``TCPStore``, ``PrefixStore``, ``ProcessGroupGloo``.
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Protocol

import torch
import torch.distributed as dist
from loguru import logger

from t1async.sampler_client import post_json

GROUP_NAME = "t1async-weights"


class WeightSyncError(RuntimeError):
    """A sampler failed to join the weight group or to take an update."""


def init_weight_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, timeout_s: float, store: dist.Store | None = None):
    """Join (rank > 0) or host (rank 0) a standalone broadcast group.

    Returns:
        A torch ProcessGroup backend object with ``broadcast(tensor, root)``.

    Raises:
        WeightSyncError: unknown backend.
        RuntimeError / DistStoreError: rendezvous failed within ``timeout_s``.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    raise WeightSyncError(f"weight_sync.backend {backend!r} is not supported: use 'gloo' (CPU) or 'nccl' (GPUs)")


class WeightSync(Protocol):
    """Learner side of weight publication."""

    def connect(self, sampler_urls: list[str]) -> None: ...
    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...


class DistributedWeightSync:
    """Broadcast weights to SGLang-protocol samplers over one torch.distributed group.

    Args:
        backend: ``gloo`` or ``nccl``.
        master_address: address samplers use to reach this process's TCPStore.
        master_port: port of the store (0: a free one).
        timeout_s: rendezvous and per-update timeout, seconds, of both ends: sent to every
            sampler as the ``timeout_s`` field of ``/init_weights_update_group`` (an extension the
            embedded sampler applies to its side of the group; SGLang ignores it).
    """

    def __init__(self, backend: str = "gloo", master_address: str = "127.0.0.1", master_port: int = 0,
                 timeout_s: float = 120.0):
        self.backend, self.master_address, self.timeout_s = backend, master_address, timeout_s
        self.master_port = master_port
        self.urls: list[str] = []
        self._group = None
        self._pool: ThreadPoolExecutor | None = None

    def connect(self, sampler_urls: list[str]) -> None:
        """Create the group: this process is rank 0, sampler i is rank i + 1.

        Raises:
            WeightSyncError: a sampler refused to join or the rendezvous timed out.
        """
        self.urls = list(sampler_urls)
        world = len(self.urls) + 1
        store = dist.TCPStore(self.master_address, self.master_port, world, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.timeout_s))
        port = store.port
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)), thread_name_prefix="weight-sync")
        futures = [
            self._pool.submit(post_json, url, "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": port, "rank_offset": i + 1,
                "world_size": world, "group_name": GROUP_NAME, "backend": self.backend,
                # t1async extension: the embedded sampler builds its side of the group with this
                # timeout, so weight_sync.timeout_s governs both ends. A real SGLang server does
                # not read this field (unknown body fields are ignored) and keeps its own timeout.
                "timeout_s": self.timeout_s,
            }, timeout_s=self.timeout_s)
            for i, url in enumerate(self.urls)
        ]
        self._group = init_weight_group(self.backend, self.master_address, port, 0, world, GROUP_NAME,
                                        self.timeout_s, store=store)
        self._store = store  # keep the store (and its port) alive as long as the group
        for url, f in zip(self.urls, futures):
            res = f.result()
            if not res.get("success", False):
                raise WeightSyncError(f"sampler {url} could not join the weight group: {res.get('message')}")
        logger.info("weight group {} ready: {} samplers, backend {}, store port {}", GROUP_NAME, len(self.urls), self.backend, port)

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast every tensor (in the given order) and make each sampler hold ``version``.

        Raises:
            WeightSyncError: called before :meth:`connect`, or a sampler reported a failure.
        """
        if self._group is None or self._pool is None:
            raise WeightSyncError("publish() before connect(): call connect(sampler_urls) first")
        tensors = [(n, t.detach()) for n, t in named_tensors]
        body = {
            "names": [n for n, _ in tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
            "group_name": GROUP_NAME,
            "flush_cache": True,
            "weight_version": str(version),
        }
        futures = [self._pool.submit(post_json, url, "/update_weights_from_distributed", body, timeout_s=self.timeout_s)
                   for url in self.urls]
        for _, t in tensors:
            t = t.contiguous()
            self._group.broadcast(t, 0).wait()
        for url, f in zip(self.urls, futures):
            res = f.result()
            if not res.get("success", False):
                raise WeightSyncError(f"sampler {url} failed to load weight version {version}: {res.get('message')}")

    def close(self) -> None:
        """Release the worker threads (the group dies with the process)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
