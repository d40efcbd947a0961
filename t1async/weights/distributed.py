"""Weight sync: the learner hands the policy to every sampler with SGLang's own protocol, by broadcast
(``weight_sync.mode: distributed``, below) or by handles to its memory (``tensor``, further below).

Protocol (SGLang 0.5.10.post1, ``tests/fixtures/sglang_schema.json``; ``model_runner.py``
``init_weights_update_group`` / ``update_weights_from_distributed``, ``utils/common.py``
``init_custom_process_group``, ``weight_sync/tensor_bucket.py``):

1. **Group join** (:meth:`DistributedWeightSync.connect`). The learner asks every sampler to
   drop an earlier group of that name (``POST /destroy_weights_update_group``; "does not exist"
   is fine), then to ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
   group_name, backend}`` while it joins itself as rank 0. Every member runs the same recipe
   (:func:`join_group`): ``torch.distributed.rendezvous("tcp://ADDR:PORT", rank, world)`` (rank 0
   hosts the TCPStore), ``PrefixStore(group_name, store)``, then torch's process-group helper,
   which prefixes ``group_name/`` once more. A server with tensor parallelism T takes T ranks,
   ``rank_offset + tp_rank``; the world is ``1 + sum of every server's T``.
2. **Update** (:meth:`DistributedWeightSync.publish`): ``POST /pause_generation {mode}`` to every
   sampler; then per bucket ``POST /update_weights_from_distributed {names, dtypes, shapes,
   group_name, flush_cache, weight_version, load_format: "flattened_bucket"}`` while the learner
   broadcasts that bucket as one uint8 tensor (the tensors' bytes concatenated in order; offsets
   follow from dtypes and shapes). Buckets hold at most ``bucket_bytes`` (a larger tensor gets a
   bucket of its own), non-expert parameters first, then the experts. Only the last bucket carries
   ``flush_cache`` and ``weight_version`` (a string); then ``POST /continue_generation``.
3. **Failure.** SGLang applies each bucket as it arrives, so a failed update leaves a server
   partly updated. A sampler that fails (an error answer, no answer within ``timeout_s``, a
   broken group) is *taken out of service*: it gets no ``/continue_generation`` (a paused SGLang
   server holds new requests; it never serves the half-updated weights), it leaves every later
   publish, and :meth:`DistributedWeightSync.publish` raises :class:`WeightSyncError` naming it
   (the learner logs it; ``failed`` lists them). The embedded sampler is atomic (it swaps all
   buckets together when the last one arrives) but is treated alike.

Timeout: ``timeout_s`` bounds the learner's side (rendezvous, each broadcast, each HTTP call).
The embedded sampler takes it too (``timeout_s`` in its ``/init_weights_update_group`` body, an
extension sent only to embedded samplers); an SGLang server keeps torch's default group timeout
(30 min), which the learner no longer waits for: it gives up after ``timeout_s`` and takes the
server out of service.

Backends: gloo (CPU) and nccl (GPUs, one rank per GPU: two NCCL ranks on one GPU fail with
"Duplicate GPU detected"). The group is a standalone process group, never the default one a
Megatron learner uses.
"""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Iterable, Sequence

import torch
from loguru import logger

from t1async.sampling.sampler_client import SamplerError, post_json
from t1async.transport.ports import free_port
from t1async.weights.buckets import Bucket, init_body, plan_buckets, update_body
from t1async.weights.group import GROUP_NAME, join_group, leave_group
from t1async.weights.members import SamplerSet, collect_answers
from t1async.weights.protocol import WeightSyncError


class DistributedWeightSync(SamplerSet):
    """Broadcast weights to SGLang-protocol samplers over one torch.distributed group.

    Args:
        backend: ``gloo`` or ``nccl``.
        master_address: address samplers use to reach this process's TCPStore.
        master_port: port of the store (0: a free one).
        timeout_s: rendezvous, broadcast and HTTP timeout of the learner's side, seconds (and of
            embedded samplers' side, see the module docstring).
        sampler_backend: ``embedded`` (sends the ``timeout_s`` extension), ``sglang``, or ``auto``
            (per sampler: embedded when its ``/model_info`` says ``model_path: t1async-embedded``).
        tp_sizes: ranks each sampler takes (its tensor parallelism), in ``connect`` order; default:
            each server's ``tp_size`` from ``GET /server_info`` (1 when absent).
        bucket_mb: most MiB per flattened bucket.
        pause_mode: ``/pause_generation`` mode (only ``abort``, see :data:`PAUSE_MODES`).

    Attributes:
        urls: the group's members. failed: ``{url: reason}`` of samplers taken out of service.
        held: ``{url: version}`` each member took from this learner (absent: a joiner).
        last_pause_s: seconds the samplers were paused by the last publish (from the pause to the
            continue; a re-formed group is formed before the pause and not counted).
        last_form_s: seconds the last publish spent re-forming the group (0: it did not).
    """

    def __init__(self, backend: str = "gloo", master_address: str = "127.0.0.1", master_port: int = 0,
                 timeout_s: float = 120.0, *, sampler_backend: str = "auto", tp_sizes: Sequence[int] | None = None,
                 bucket_mb: float = 512.0, pause_mode: str = "abort"):
        if sampler_backend not in ("embedded", "sglang", "auto"):
            raise WeightSyncError(f"sampler backend {sampler_backend!r}: use 'embedded', 'sglang' or 'auto'")
        super().__init__(timeout_s, bucket_mb=bucket_mb, pause_mode=pause_mode, tp_sizes=tp_sizes)
        self.backend, self.master_address = backend, master_address
        self.master_port, self.sampler_backend = master_port, sampler_backend
        self._group = None
        self._regroup = False
        self._send_bufs: list[torch.Tensor] = []

    def connect(self, sampler_urls: list[str]) -> None:
        """Form the group: this process is rank 0; sampler i takes ranks ``1 + sum(tp[:i]) ...``.

        Raises:
            WeightSyncError: a sampler refused to join or the rendezvous timed out.
        """
        self.failed = {}
        self.held = {}
        with self._members_lock:
            self._want = None
        self._form(list(sampler_urls), probe=False)
        self._connected = True

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, urls: list[str]) -> None:
        """Give ``urls`` (joiners) ``version`` at once, in a group of their own: the samplers in
        service are neither paused nor re-formed (they join the new members' group at the next
        publish). Only call it with the weights ``version`` was published as.

        Raises:
            WeightSyncError: a joiner failed (it is listed in ``failed`` and left out of service).
        """
        own = DistributedWeightSync(self.backend, self.master_address, 0, self.timeout_s,
                                    sampler_backend=self.sampler_backend, bucket_mb=self.bucket_bytes / (1 << 20),
                                    pause_mode=self.pause_mode)
        try:
            own.connect(urls)
            own.publish(named_tensors, version)
            own._all("/destroy_weights_update_group", {"group_name": GROUP_NAME}, urls)
        except WeightSyncError as e:
            bad = own.failed or {u: str(e) for u in urls}
            self.failed.update(bad)
            raise WeightSyncError(f"joiners could not load weight version {version}: {bad}") from None
        finally:
            own.close()
        for u in urls:
            self.held[u] = version
        self._regroup = True  # the group in service does not hold them yet

    def _form(self, urls: list[str], *, probe: bool = True) -> list[str]:
        """A new group of this process (rank 0) and ``urls``; returns the members. With ``probe``,
        a sampler that does not answer ``/server_info`` (dead, restarting) is taken out of service
        first instead of holding the rendezvous for ``timeout_s``.

        Raises:
            WeightSyncError: a sampler refused to join, or the rendezvous failed.
        """
        if self._group is not None:
            leave_group(self._group)
            self._group = None
        self._regroup = False
        t0 = time.monotonic()
        self._ensure_pool(len(urls))
        if self.tp_sizes and len(self.tp_sizes) < len(urls):
            raise WeightSyncError(f"tp_sizes {self.tp_sizes} must give a positive size for each of {len(urls)} samplers")
        tp, embedded, ok = [], [], []
        for i, u in enumerate(urls):
            try:
                size = self.tp_sizes[i] if self.tp_sizes else int(post_json(
                    u, "/server_info", method="GET", timeout_s=self.timeout_s).get("tp_size") or 1)
                emb = self.sampler_backend == "embedded" or (self.sampler_backend == "auto" and post_json(
                    u, "/model_info", method="GET", timeout_s=self.timeout_s).get("model_path") == "t1async-embedded")
            except SamplerError as e:
                if not probe:
                    raise WeightSyncError(f"cannot reach a sampler before forming the weight group: {e}") from None
                self.failed[u] = f"unreachable when the weight group was formed: {e}"
                logger.error("sampler {} left out of the weight group: {}", u, e)
                continue
            tp.append(size)
            embedded.append(emb)
            ok.append(u)
        self.urls = ok
        if min(tp, default=1) < 1:
            raise WeightSyncError(f"tp_sizes {tp} must give a positive size for each of {len(self.urls)} samplers")
        if not self.urls:
            return []
        world = 1 + sum(tp)
        port = self.master_port or free_port(self.master_address)
        # a server keeps its group by name until told (a learner restart, or a re-formed group
        # after a failure, would otherwise be refused "group name already created")
        self._all("/destroy_weights_update_group", {"group_name": GROUP_NAME}, self.urls)
        offsets = [1 + sum(tp[:i]) for i in range(len(self.urls))]
        futures = [self._pool.submit(post_json, url, "/init_weights_update_group",
                                     init_body(self.master_address, port, off, world, self.backend,
                                                self.timeout_s if emb else None),
                                     timeout_s=self.timeout_s)
                   for url, off, emb in zip(self.urls, offsets, embedded)]
        try:
            self._group = join_group(self.backend, self.master_address, port, 0, world, GROUP_NAME, self.timeout_s)
        except Exception as e:
            errors = [f"{u}: {f.exception()}" for u, f in zip(self.urls, futures) if f.done() and f.exception()]
            self._regroup = True
            raise WeightSyncError(f"weight group rendezvous at {self.master_address}:{port} failed within "
                                  f"{self.timeout_s:.0f} s ({type(e).__name__}: {e}); sampler errors: {errors}") from None
        for url, f in zip(self.urls, futures):
            try:
                res = f.result(timeout=self.timeout_s)
            except (SamplerError, FutureTimeout) as e:
                self._regroup = True
                raise WeightSyncError(f"sampler {url} could not join the weight group: {e}") from None
            if not res.get("success", False):
                self._regroup = True
                raise WeightSyncError(f"sampler {url} could not join the weight group: {res.get('message')}")
        self.last_form_s = time.monotonic() - t0
        logger.info("weight group {} ready: {} samplers ({} ranks), backend {}, rendezvous port {}, {:.2f} s",
                    GROUP_NAME, len(self.urls), world - 1, self.backend, port, self.last_form_s)
        return self.urls

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Pause every sampler, broadcast every bucket, make each hold ``version``, continue them.

        When the membership changed (:meth:`set_members`) or a sampler failed last time, the group
        is re-formed first, before anyone is paused. When a sampler fails, the others may hold part
        of the new weights (SGLang applies each bucket on arrival), so they stay paused while the
        group is re-formed without the failed ones and the whole update is sent to them again;
        only samplers holding all of ``version`` are continued. With no member at all (every
        sampler departed: the launch's pool is restarting them) nothing is sent; joiners get the
        version from :meth:`load` or the next publish.

        Raises:
            WeightSyncError: called before :meth:`connect`, or samplers failed (they are out of
                service from now on: paused, left out of later publishes, listed in ``failed``).
        """
        if not self._connected:
            raise WeightSyncError("publish() before connect(): call connect(sampler_urls) first")
        buckets = plan_buckets(named_tensors, self.bucket_bytes)
        live = self.members()
        self.last_form_s = 0.0
        self.last_pause_s = 0.0
        if not live:
            logger.warning("weight version {}: no sampler in service to publish to (failed: {})", version, self.failed)
            return
        bad: list[str] = []
        if self._regroup or self._group is None or live != self.urls:  # before the pause: the others keep serving
            try:
                self._form(live)
            except WeightSyncError as e:  # nobody was paused: they keep serving the last version; tried again next time
                self._regroup = True
                raise WeightSyncError(f"weight version {version} not published: the weight group could not be "
                                      f"formed ({e}); the next publish forms it again") from None
            left_out = [u for u in live if u not in self.urls]  # did not answer the probe: failed
            live = list(self.urls)
            if not live:
                raise WeightSyncError(f"weight version {version}: no sampler answered, now out of service: "
                                      f"{[f'{u}: {self.failed[u]}' for u in left_out]}")
        else:
            left_out = []
        t0 = time.monotonic()
        try:
            errors = self._all("/pause_generation", {"mode": self.pause_mode}, live)
            if not errors:
                errors = self._send(buckets, live, version)
            for attempt in range(2):
                if not errors:
                    break
                new_bad = [u for u in live if u in errors] or list(live)  # a broken group takes every member
                for u in new_bad:
                    self.failed[u] = errors.get(u) or errors.get("(group)", "group broken")
                bad += new_bad
                live = [u for u in live if u not in new_bad]
                errors = {}
                if live and attempt == 0:  # the rest may be partly updated: reload them in a new group
                    try:
                        self._form(live)
                    except WeightSyncError as e:
                        errors = {u: str(e) for u in live}
                        continue
                    bad += [u for u in live if u not in self.urls]
                    live = list(self.urls)
                    errors = self._send(buckets, live, version) if live else {}
                elif live:
                    bad += live
                    for u in live:
                        self.failed[u] = "failed the reload after another sampler failed"
                    live = []
            self._regroup = bool(bad)  # a member failed mid-update: form the group anew next time
            bad += left_out
            cont = self._all("/continue_generation", {}, live) if live else {}
        finally:
            self.last_pause_s = time.monotonic() - t0
        for u in live:
            if u not in cont:
                self.held[u] = version
        if bad:
            self._out_of_service(version, bad)
        if cont:
            self.failed.update(cont)
            self._regroup = True
            raise WeightSyncError(f"samplers did not continue after weight version {version}: {cont}")

    def _send(self, buckets: list[Bucket], urls: list[str], version: int) -> dict[str, str]:
        """Broadcast every bucket to ``urls`` (each answers its ``/update_weights_from_distributed``);
        ``{url or "(group)": error}``, empty when all took every bucket."""
        assert self._group is not None and self._pool is not None
        errors: dict[str, str] = {}
        # send buffers kept from one publish to the next (warm memory; two, so one is filled
        # while the other is on the wire)
        big, dev = max(b.nbytes for b in buckets), buckets[0].tensors[0].device
        if len(self._send_bufs) < 2 or self._send_bufs[0].numel() < big or self._send_bufs[0].device != dev:
            self._send_bufs = [torch.empty(big, dtype=torch.uint8, device=dev) for _ in range(2)]
        flat = buckets[0].flatten(self._send_bufs[0][:buckets[0].nbytes])
        for i, b in enumerate(buckets):
            body = update_body(b, last=i == len(buckets) - 1, version=version)
            futures = {u: self._pool.submit(post_json, u, "/update_weights_from_distributed", body,
                                            timeout_s=self.timeout_s) for u in urls}
            try:
                work = self._group.broadcast(flat, 0)
                if i + 1 < len(buckets):  # concatenated while the previous one is on the wire
                    nxt = buckets[i + 1]
                    flat = nxt.flatten(self._send_bufs[(i + 1) % 2][:nxt.nbytes])
                work.wait()
            except Exception as e:
                errors["(group)"] = f"broadcast of bucket {i} failed: {type(e).__name__}: {e}"
            collect_answers(futures, i, self.timeout_s, errors)
            if errors:
                break  # the group is out of step once a member missed a broadcast
        return errors

    def close(self) -> None:
        """Leave the group and release the worker threads."""
        self._connected = False
        if self._group is not None:
            leave_group(self._group)
            self._group = None
        self._close_pool()
