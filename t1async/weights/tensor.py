"""Tensor mode (``weight_sync.mode: tensor``): weights handed to samplers on this machine as
handles to the learner's memory (t1async/weights/handles.py says what SGLang's route expects)."""

from __future__ import annotations

import os
import time
from typing import Any, Iterable, Sequence

import torch
from loguru import logger

from t1async.sampling.sampler_client import SamplerError, post_json
from t1async.weights.buckets import Bucket, plan_buckets, tensor_update_body
from t1async.weights.handles import serialize_named_tensors
from t1async.weights.members import SamplerSet, collect_answers
from t1async.weights.protocol import WeightSyncError


def aligned_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to 64: where the next tensor starts in a staging buffer, so that a
    uint8 slice of it can be viewed as any dtype."""
    return (nbytes + 63) // 64 * 64


class TensorWeightSync(SamplerSet):
    """Hand weights to samplers on this machine with SGLang's ``/update_weights_from_tensor``: each
    bucket travels as handles to this process's memory (CUDA IPC on GPU, named shared memory on
    CPU), the receiver copies during the request. No process group is formed, so it also serves a
    sampler on the learner's own GPU (two NCCL ranks on one GPU fail: "Duplicate GPU detected").

    A publish is the distributed one's sequence: ``/pause_generation`` to every sampler, one
    ``/update_weights_from_tensor`` per bucket (publish order and ``bucket_mb`` as
    :func:`plan_buckets`; ``weight_version`` and ``flush_cache`` with the last), then
    ``/continue_generation`` to those that took every bucket. The samplers share no group, so one
    that fails (an error answer, no answer within ``timeout_s``) is taken out of service alone (left
    paused: SGLang applies each bucket as it comes) and the others carry on with the same update.

    A bucket whose tensors lie back to back in one storage (a policy laid out by
    :func:`pack_parameters`) is sent as views of the policy's own memory: nothing is copied on the
    learner's side (on CPU that storage moves into shared memory at the first publish, once).
    Otherwise the bucket is copied into one of two staging buffers, kept from one publish to the
    next, while the previous bucket is in flight, so every bucket is one storage (one CUDA IPC
    handle for the receiver to open, not one per tensor). The learner does not touch a bucket's
    memory until every sampler answered that bucket (the answer means it copied), then reuses it.

    Args:
        timeout_s: timeout of each HTTP call (a bucket's answer comes after the receiver copied it).
        tp_sizes: TP ranks of each sampler in ``connect`` order (default: ``/server_info``
            ``tp_size``, 1 when absent): one serialized entry per rank.
        bucket_mb, pause_mode: as :class:`DistributedWeightSync`.

    Attributes:
        As :class:`DistributedWeightSync`; ``urls`` are the samplers of the last publish and
        ``last_form_s`` is always 0 (no group).
    """

    def __init__(self, timeout_s: float = 120.0, *, tp_sizes: Sequence[int] | None = None,
                 bucket_mb: float = 512.0, pause_mode: str = "abort"):
        super().__init__(timeout_s, bucket_mb=bucket_mb, pause_mode=pause_mode, tp_sizes=tp_sizes)
        self._tp: dict[str, int] = {}
        self._stage: list[torch.Tensor] = []

    def connect(self, sampler_urls: list[str]) -> None:
        """Learn each sampler's TP size (``/server_info``); nothing else is set up.

        Raises:
            WeightSyncError: a sampler did not answer, or ``tp_sizes`` is too short or not positive.
        """
        urls = list(sampler_urls)
        self.failed, self.held, self._tp = {}, {}, {}
        with self._members_lock:
            self._want = None
        if self.tp_sizes is not None:
            if len(self.tp_sizes) < len(urls) or min(self.tp_sizes, default=1) < 1:
                raise WeightSyncError(f"tp_sizes {self.tp_sizes} must give a positive size for each of "
                                      f"{len(urls)} samplers")
            self._tp = dict(zip(urls, self.tp_sizes))
        self._ensure_pool(len(urls))
        for u in urls:
            try:
                self._probe(u)
            except SamplerError as e:
                raise WeightSyncError(f"cannot reach a sampler before the first publish: {e}") from None
        self.urls = urls
        self._connected = True

    def _probe(self, url: str) -> int:
        if url not in self._tp:
            size = int(post_json(url, "/server_info", method="GET", timeout_s=self.timeout_s).get("tp_size") or 1)
            if size < 1:
                raise SamplerError(f"{url} reports tp_size {size}")
            self._tp[url] = size
        return self._tp[url]

    def _reachable(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """(those whose TP size is known or answered ``/server_info``, those taken out of service)."""
        ok, gone = [], []
        for u in urls:
            try:
                self._probe(u)
                ok.append(u)
            except SamplerError as e:
                self.failed[u] = f"unreachable before the update: {e}"
                gone.append(u)
        return ok, gone

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Pause every sampler, send every bucket, make each hold ``version``, continue them. With no
        member in service nothing is sent (as :meth:`DistributedWeightSync.publish`).

        Raises:
            WeightSyncError: called before :meth:`connect`, or samplers failed (now out of service:
                paused, left out of later publishes, listed in ``failed``).
        """
        if not self._connected:
            raise WeightSyncError("publish() before connect(): call connect(sampler_urls) first")
        buckets = plan_buckets(named_tensors, self.bucket_bytes)
        self.last_form_s = self.last_pause_s = 0.0
        live = self.members()
        if not live:
            logger.warning("weight version {}: no sampler in service to publish to (failed: {})", version, self.failed)
            return
        self._check_shared_memory(buckets)
        self._ensure_pool(len(live))
        self.urls = live
        live, gone = self._reachable(live)
        bad, cont = self._update(buckets, live, version)
        bad += gone
        if bad:
            self._out_of_service(version, bad)
        if cont:
            raise WeightSyncError(f"samplers did not continue after weight version {version}: {cont}")

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, urls: list[str]) -> None:
        """Give ``urls`` (joiners) ``version`` at once; the samplers in service are not paused. Only
        call it with the weights ``version`` was published as.

        Raises:
            WeightSyncError: a joiner failed (it is listed in ``failed`` and left out of service).
        """
        buckets = plan_buckets(named_tensors, self.bucket_bytes)
        self._check_shared_memory(buckets)
        self._ensure_pool(len(urls))
        live, gone = self._reachable(list(urls))
        bad, cont = self._update(buckets, live, version)
        bad = {u: self.failed[u] for u in bad + gone + list(cont)}
        if bad:
            raise WeightSyncError(f"joiners could not load weight version {version}: {bad}")

    def _update(self, buckets: list[Bucket], urls: list[str], version: int) -> tuple[list[str], dict[str, str]]:
        """Pause ``urls``, send every bucket, continue those that took all; returns (samplers that
        failed, ``{url: error}`` of those that did not continue), both added to ``failed``."""
        t0 = time.monotonic()
        try:
            errors = self._all("/pause_generation", {"mode": self.pause_mode}, urls)
            ok = [u for u in urls if u not in errors]
            if ok:
                errors.update(self._send(buckets, ok, version))
            ok = [u for u in urls if u not in errors]
            cont = self._all("/continue_generation", {}, ok) if ok else {}
        finally:
            self.last_pause_s = time.monotonic() - t0
        for u in ok:
            if u not in cont:
                self.held[u] = version
        self.failed.update(errors)
        self.failed.update(cont)
        return [u for u in urls if u in errors], cont

    def _check_shared_memory(self, buckets: list[Bucket], shm: str = "/dev/shm") -> None:
        """On CPU, refuse before anyone is paused when what must move into shared memory now (the
        packed policy's storage at its first publish, the staging buffers) does not fit in ``shm``
        (a container's default is 64 MiB; writing past it kills the process with SIGBUS).

        Raises:
            WeightSyncError: one line with the MiB needed and free.
        """
        if buckets[0].tensors[0].device.type != "cpu" or not os.path.isdir(shm):
            return
        need, seen, staged = 0, set(), 0
        for b in buckets:
            if b._packed_view() is not None:
                st = b.tensors[0].untyped_storage()
                if st.data_ptr() not in seen and not st.is_shared():
                    need += st.nbytes()
                seen.add(st.data_ptr())
            else:
                staged = max(staged, sum(aligned_bytes(t.numel() * t.element_size()) for t in b.tensors))
        have = [t.numel() for t in self._stage]
        need += sum(max(0, staged - (have[k] if k < len(have) else 0)) for k in range(2 if staged else 0))
        st = os.statvfs(shm)
        free = st.f_bavail * st.f_frsize
        if need > free:
            raise WeightSyncError(f"weight_sync.mode=tensor on CPU must put {need / 2**20:.0f} MiB in {shm}, which has "
                                  f"{free / 2**20:.0f} MiB free: enlarge it (docker run --shm-size) or use "
                                  "weight_sync.mode=distributed")

    def _named(self, bucket: Bucket, i: int) -> list[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` list sent for ``bucket`` (number ``i``): views of the policy when
        the bucket is packed, else views of staging buffer ``i % 2`` holding a copy."""
        if bucket._packed_view() is not None:
            return list(zip(bucket.names, bucket.tensors))
        dev = bucket.tensors[0].device
        need = sum(aligned_bytes(t.numel() * t.element_size()) for t in bucket.tensors)
        while len(self._stage) < 2:
            self._stage.append(torch.empty(0, dtype=torch.uint8, device=dev))
        k = i % 2
        if self._stage[k].numel() < need or self._stage[k].device != dev:
            self._stage[k] = torch.empty(need, dtype=torch.uint8, device=dev)
        out, at = [], 0
        for n, t in zip(bucket.names, bucket.tensors):
            size = t.numel() * t.element_size()
            view = self._stage[k][at:at + size].view(t.dtype).view(t.shape)
            view.copy_(t)
            out.append((n, view))
            at += aligned_bytes(size)
        return out

    def _bodies(self, urls: list[str], named: list[tuple[str, torch.Tensor]], last: bool,
                version: int) -> dict[str, dict[str, Any]]:
        """Each sampler's body for one bucket, serialized here in the calling thread (the first
        serialization may move a storage into shared memory; never two threads at once). One
        pickle per TP rank: each carries a reference its reader gives back (SGLang's own
        weight_sync/utils.py ``update_weights`` also serializes once per rank)."""
        return {u: tensor_update_body([serialize_named_tensors(named) for _ in range(self._tp.get(u, 1))],
                                      last=last, version=version) for u in urls}

    def _send(self, buckets: list[Bucket], urls: list[str], version: int) -> dict[str, str]:
        """Every bucket to ``urls``; ``{url: error}`` of those that failed (each stops receiving)."""
        assert self._pool is not None
        errors: dict[str, str] = {}
        live = list(urls)
        named = self._named(buckets[0], 0)
        for i in range(len(buckets)):
            last = i == len(buckets) - 1
            bodies = self._bodies(live, named, last, version)
            futures = {u: self._pool.submit(post_json, u, "/update_weights_from_tensor", body, timeout_s=self.timeout_s)
                       for u, body in bodies.items()}
            if not last:  # staged while this bucket is in flight (the other staging buffer)
                named = self._named(buckets[i + 1], i + 1)
            collect_answers(futures, i, self.timeout_s, errors)
            live = [u for u in live if u not in errors]
            if not live:
                break
        return errors

    def close(self) -> None:
        """Release the worker threads and the staging buffers."""
        self._connected = False
        self._stage = []
        self._close_pool()
