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

**Tensor mode** (``weight_sync.mode: tensor``, :class:`TensorWeightSync`): for samplers on the
learner's machine, including its own GPU, where no group can be formed. Same pause -> buckets ->
continue sequence, same ``bucket_mb``, publish order, ``timeout_s`` and out-of-service rule; per
bucket ``POST /update_weights_from_tensor``. What it relies on, read from the pinned release:

- Body (``managers/io_struct.py`` ``UpdateWeightsFromTensorReqInput``): ``serialized_named_tensors:
  List[Union[str, bytes]]`` (required), ``load_format: Optional[str] = None``, ``flush_cache: bool =
  True``, ``abort_all_requests: bool = False``, ``weight_version: Optional[str] = None`` (and
  ``disable_draft_model``). t1async sends exactly the five first (:func:`tensor_update_body`):
  ``flush_cache`` false and ``weight_version`` null except on the last bucket (the default
  ``flush_cache`` is true, so it is sent explicitly).
- Per TP rank (``managers/tp_worker.py`` ``update_weights_from_tensor``): rank ``r`` loads
  ``MultiprocessingSerializer.deserialize(serialized_named_tensors[r])`` after
  ``monkey_patch_torch_reductions()``; so the list holds one entry per rank (a short list fails a
  rank). ``utils/common.py`` ``MultiprocessingSerializer``: ``ForkingPickler(buf).dump(obj)``,
  base64 (``output_str=True``); ``deserialize`` base64-decodes a str (``validate=True``) and loads it
  with ``SafeUnpickler``, which allows modules by prefix (``torch.``, ``builtins.``,
  ``multiprocessing.reduction.``, ``sglang.srt.weight_sync.tensor_bucket.`` ...) and denies
  ``os.system``, ``eval`` and a few more. ``utils/patch_torch.py``: the patched reduction puts the
  GPU's UUID in place of the device index (argument 6 of ``rebuild_cuda_tensor``) and the patched
  rebuild takes an index or a UUID; the patch assumes a CUDA tensor (it breaks CPU tensors, so
  :func:`_reduce_tensor` rewrites CUDA tensors only).
- Loading (``model_executor/model_runner.py`` ``update_weights_from_tensor``): ``load_format`` null
  means a list of ``(name, tensor)``, each ``.to(device)`` (``_unwrap_tensor``, which also unwraps
  ``LocalSerializedTensor``, a per-rank wrapper t1async does not need: every rank gets the whole
  tensor) then ``model.load_weights``, which copies into the server's parameters during the request;
  the HTTP answer (``entrypoints/http_server.py``: 200, or 400 with ``success`` false) means the
  bytes were copied and the sender may reuse them. ``flattened_bucket`` means one dict
  ``{"flattened_tensor", "metadata"}`` whose metadata are objects with ``name, shape, dtype,
  start_idx, end_idx, numel`` attributes (``weight_sync/tensor_bucket.py``
  ``FlattenedTensorMetadata``): t1async sends the plain list instead, which needs no SGLang class in
  the pickle (the learner does not install SGLang) and goes through ``_unwrap_tensor``'s per-rank
  ``.to(device)``, which the flattened path skips (sglang#12664: wrong device with TP > 1). What
  the flattened form saves, one CUDA IPC handle per bucket instead of one per tensor (slow for
  thousands of tensors, vime#175), the plain list gets here too: every tensor of a bucket is a view
  of one storage (the packed policy, or a staging buffer) and torch's receiver opens a storage
  once (``shared_cache`` by handle).
- ``managers/tokenizer_communicator_mixin.py``: while paused the update runs at once (no writer
  lock); a ``weight_version`` is taken only on success. No ``try`` around the load in
  ``model_runner``: an exception there (a name the model lacks) ends SGLang's scheduler, and the
  server with it; the learner sees no answer and takes it out of service, as for a 400.
- Handles (torch ``multiprocessing/reductions.py``): a CUDA tensor pickles as a CUDA IPC handle of
  its allocation with a producer-side reference count (the producer keeps the memory while a
  consumer holds it); a CPU tensor as shared memory: the default ``file_descriptor`` strategy
  sends an fd that only a process holding this one's multiprocessing authkey can fetch, so the
  pickler here uses ``file_system`` (a named file in ``/dev/shm``) whatever the process-wide
  strategy (:func:`serialize_named_tensors`). Each pickle takes one reference that its reader gives
  back, so every rank gets its own pickle (as SGLang's ``weight_sync/utils.py`` does); a pickle
  that is never read (the sampler died first) leaves its shared-memory file until torch's
  ``torch_shm_manager`` removes it when the learner exits.
- verl and slime (read, not copied) call the same route for colocated engines with SGLang imported
  in the trainer (``MultiprocessingSerializer``, ``monkey_patch_torch_reductions``, and
  ``FlattenedTensorBucket`` where the release has it; verl's earlier FSDP path sent per-tensor
  ``LocalSerializedTensor`` lists): a bucket per call, one entry per TP rank. t1async imports no
  SGLang, hence its own pickler with the same output.

The embedded sampler implements the route (actors/sampler.py), atomically: it loads the pickle with
an exact allow-list of torch's rebuild functions (:func:`deserialize_named_tensors`; SGLang's
prefix list would admit any ``torch.`` callable), checks names, shapes and dtypes (400 naming the
tensor), copies into its receive buffers during the request and swaps all buckets in at the last.
Needs the same machine; launch refuses ``sampler.urls`` on another host. Not run on a GPU yet.
"""

from __future__ import annotations

import base64
import datetime
import io
import os
import pickle
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

import torch
import torch.distributed as dist
from loguru import logger

from t1async.sampling.sampler_client import SamplerError, post_json
from torch.multiprocessing import reductions
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
from multiprocessing.reduction import ForkingPickler

GROUP_NAME = "t1async-weights"
PAUSE_MODES = ("abort",)
"""Pause modes t1async accepts. SGLang also has ``retract`` and ``in_place``, which keep requests
alive across the update; the pinned release reports no per-token weight versions, so their
tokens would be labelled with one version while spanning two: refused."""


class WeightSyncError(RuntimeError):
    """A sampler failed to join the weight group or to take an update."""


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the rendezvous needs the port before rank 0 binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    tests/test_sglang_backends.py checks that it meets members built with the helper itself.

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


def is_expert(name: str) -> bool:
    """Whether a parameter name is an MoE expert's: Hugging Face ``...mlp.experts.N...`` or
    Megatron ``...mlp.experts.local_experts.N...`` (the megatron backend's expert-parallel ranks)."""
    return ".experts." in name


@dataclass
class Bucket:
    """One flattened bucket: tensors broadcast as one uint8 tensor, in this order.

    Attributes:
        names, dtypes (torch dtype names, e.g. ``"bfloat16"``), shapes: per tensor.
        tensors: the (contiguous, detached) tensors.
        nbytes: total bytes.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    tensors: list[torch.Tensor]
    nbytes: int

    def flatten(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [nbytes]: every tensor's bytes concatenated (SGLang ``FlattenedTensorBucket``).

        When the tensors already lie back to back in one storage, in this order (a module laid
        out by :func:`pack_parameters`), this is a view of those bytes: nothing is copied, and it
        aliases the tensors (send it before they change). Otherwise the bytes are copied, into
        ``out`` when it is a uint8 tensor of that size on the tensors' device."""
        view = self._packed_view()
        if view is not None:
            return view
        parts = [t.reshape(-1).view(torch.uint8) for t in self.tensors]
        if out is not None and out.numel() == self.nbytes and out.dtype == torch.uint8 \
                and out.device == self.tensors[0].device:
            return torch.cat(parts, out=out)
        return torch.cat(parts)

    def _packed_view(self) -> torch.Tensor | None:
        """uint8 view of the bucket's bytes when its tensors are adjacent in one storage, else None."""
        first = self.tensors[0]
        storage = first.untyped_storage()
        at = first.data_ptr()
        for t in self.tensors:
            if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr() or t.data_ptr() != at:
                return None
            at += t.numel() * t.element_size()
        offset = first.data_ptr() - storage.data_ptr()
        return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, offset, (self.nbytes,))


def publish_order(names: Iterable[str]) -> list[str]:
    """``names`` in the order :func:`plan_buckets` sends them: non-expert parameters first, then
    experts, each in the given order."""
    names = list(names)
    return [n for n in names if not is_expert(n)] + [n for n in names if is_expert(n)]


def pack_parameters(module: torch.nn.Module) -> bool:
    """Lay ``module``'s parameters out back to back in one flat storage, in :func:`publish_order`,
    so that every bucket of a publish is a view of it (:meth:`Bucket.flatten` copies nothing),
    as Megatron's contiguous parameter buffer and DDP's gradient buckets do.

    Each parameter keeps its identity, name, shape and values (its ``.data`` becomes a view;
    build optimizers before or after, as they hold the parameter objects). Anything that later
    gives a parameter new storage (``Module.to`` to another dtype or device, ``load_state_dict``
    with ``assign=True``) undoes the packing for that parameter, which only costs the copy again.

    Returns:
        False, and nothing changes, when the parameters differ in dtype or device; else True.
    """
    params = dict(module.named_parameters())
    if not params or len({(p.dtype, p.device) for p in params.values()}) != 1:
        return False
    order = [params[n] for n in publish_order(params)]
    first = order[0]
    flat = torch.empty(sum(p.numel() for p in order), dtype=first.dtype, device=first.device)
    at = 0
    with torch.no_grad():
        for p in order:
            n = p.numel()
            flat[at:at + n].copy_(p.data.reshape(-1))
            p.data = flat[at:at + n].view(p.shape)
            at += n
    return True


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """Group tensors into buckets of at most ``bucket_bytes``: non-expert parameters first, then
    experts, each in the given order; a tensor larger than ``bucket_bytes`` gets its own bucket.

    Raises:
        WeightSyncError: ``bucket_bytes`` < 1 or no tensors.
    """
    if bucket_bytes < 1:
        raise WeightSyncError(f"weight_sync.bucket_mb must be positive, got {bucket_bytes} bytes")
    items = [(n, t.detach().contiguous()) for n, t in named_tensors]
    if not items:
        raise WeightSyncError("no tensors to publish")
    by_name = dict(items)
    items = [(n, by_name[n]) for n in publish_order(by_name)]
    buckets: list[Bucket] = []
    cur: Bucket | None = None
    for n, t in items:
        size = t.numel() * t.element_size()
        if cur is None or (cur.nbytes + size > bucket_bytes and cur.tensors):
            cur = Bucket([], [], [], [], 0)
            buckets.append(cur)
        cur.names.append(n)
        cur.dtypes.append(str(t.dtype).removeprefix("torch."))
        cur.shapes.append(list(t.shape))
        cur.tensors.append(t)
        cur.nbytes += size
    return buckets


def update_body(bucket: Bucket, *, last: bool, version: int, group_name: str = GROUP_NAME) -> dict[str, Any]:
    """The ``/update_weights_from_distributed`` body of one bucket (fields of SGLang's
    ``UpdateWeightsFromDistributedReqInput``); ``flush_cache`` and ``weight_version`` only on the last."""
    body: dict[str, Any] = {"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes,
                            "group_name": group_name, "load_format": "flattened_bucket", "flush_cache": last}
    if last:
        body["weight_version"] = str(version)
    return body


def sglang_bodies_example() -> dict[str, dict[str, Any]]:
    """One body per route as :class:`DistributedWeightSync` and :class:`TensorWeightSync` send it to
    an SGLang server (checked
    against the pinned release's dataclasses by tests/test_sglang_conformance.py)."""
    b = plan_buckets([("w", torch.zeros(2))], 1 << 20)[0]
    return {
        "/init_weights_update_group": _init_body("127.0.0.1", 1, 1, 2, "gloo", None),
        "/destroy_weights_update_group": {"group_name": GROUP_NAME},
        "/pause_generation": {"mode": "abort"},
        "/update_weights_from_distributed": update_body(b, last=True, version=3),
        "/update_weights_from_tensor": tensor_update_body(["e30="], last=True, version=3),
        "/continue_generation": {},
    }


def _init_body(address: str, port: int, rank_offset: int, world: int, backend: str,
               timeout_s: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {"master_address": address, "master_port": port, "rank_offset": rank_offset,
                            "world_size": world, "group_name": GROUP_NAME, "backend": backend}
    if timeout_s is not None:
        body["timeout_s"] = timeout_s  # embedded samplers only (not a field of SGLang's request)
    return body


# ---- tensor mode: SGLang's /update_weights_from_tensor (CUDA IPC on GPU, shared memory on CPU) -----

_CUDA_DEVICE_ARG = 6
"""Index of the device in the arguments torch's ``reduce_tensor`` gives ``rebuild_cuda_tensor``
(SGLang ``utils/patch_torch.py`` ``_REDUCE_TENSOR_ARG_DEVICE_INDEX``)."""


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _reduce_tensor(tensor: torch.Tensor):
    """torch's tensor reduction; for a CUDA tensor the device index is replaced by the GPU's UUID,
    as SGLang's patched reduction does, so a receiver with other ``CUDA_VISIBLE_DEVICES`` finds it."""
    fn, args = reductions.reduce_tensor(tensor)
    if fn is reductions.rebuild_cuda_tensor:
        args = (*args[:_CUDA_DEVICE_ARG], _device_uuid(args[_CUDA_DEVICE_ARG]), *args[_CUDA_DEVICE_ARG + 1:])
    return fn, args


def _reduce_cpu_storage(storage):
    """torch's ``file_system`` reduction of a CPU storage, whatever the process-wide sharing strategy:
    the storage moves into a named shared-memory file (once; later publishes reuse it) that an
    unrelated process opens by name. (``file_descriptor``, torch's default on Linux, passes the fd
    over a connection that needs this process's multiprocessing authkey.)"""
    if storage.device.type != "cpu":
        raise WeightSyncError(f"cannot share a {storage.device.type} storage by file name")
    if storage.size() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild takes this reference back
    reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage),) + metadata


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One entry of ``serialized_named_tensors``: base64 of a ``ForkingPickler`` pickle of ``named``,
    as SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` makes it. The pickle
    holds handles, not bytes: CUDA IPC handles for CUDA tensors (device as its UUID), named shared
    memory (``file_system``) for CPU tensors. The handles stay valid while the tensors live and
    each pickle carries one reference per read, so make one per reader (per TP rank).
    Process-wide state is left alone: the reductions are this pickler's own dispatch table."""
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    pickler.dispatch_table[torch.nn.Parameter] = _reduce_tensor
    pickler.dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _rebuild_cuda_tensor(*args):
    """torch's ``rebuild_cuda_tensor`` that also takes the device as a GPU UUID (SGLang's patch)."""
    dev = args[_CUDA_DEVICE_ARG]
    if isinstance(dev, str):
        found = [i for i in range(torch.cuda.device_count()) if _device_uuid(i) == dev]
        if not found:
            raise WeightSyncError(f"tensor on GPU {dev}, which this process does not see (CUDA_VISIBLE_DEVICES)")
        args = (*args[:_CUDA_DEVICE_ARG], found[0], *args[_CUDA_DEVICE_ARG + 1:])
    return reductions.rebuild_cuda_tensor(*args)


class _TensorUnpickler(pickle.Unpickler):
    """Loads what :func:`serialize_named_tensors` writes and nothing else: an exact allow-list of
    torch's rebuild functions and types (SGLang's ``SafeUnpickler`` allows whole module prefixes
    such as ``torch.``; a pickle from the network is code, so this one is narrower)."""

    _REDUCTIONS = {"rebuild_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
                   "rebuild_storage_filename", "rebuild_storage_empty"}

    def find_class(self, module: str, name: str):
        if module == "torch.multiprocessing.reductions":
            if name == "rebuild_cuda_tensor":
                return _rebuild_cuda_tensor
            if name in self._REDUCTIONS:
                return getattr(reductions, name)
        elif module == "torch" and (name in ("Tensor", "Size", "UntypedStorage", "TypedStorage")
                                    or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        elif (module, name) in (("torch._tensor", "Tensor"), ("torch.nn.parameter", "Parameter"),
                                ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused {module}.{name}: not a tensor, storage or dtype of torch's "
                                     "shared-memory or CUDA IPC reductions (file descriptors are refused: "
                                     "the sender must use the file_system strategy)")


def deserialize_named_tensors(data: str | bytes) -> Any:
    """The object :func:`serialize_named_tensors` pickled (base64 text or raw bytes, like SGLang's
    ``MultiprocessingSerializer.deserialize``), through :class:`_TensorUnpickler`.

    Raises:
        ValueError: not base64; pickle.UnpicklingError: a global outside the allow-list;
        RuntimeError/OSError: a handle that cannot be opened (another machine, memory gone).
    """
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return _TensorUnpickler(io.BytesIO(data)).load()


def tensor_update_body(serialized: list[str], *, last: bool, version: int) -> dict[str, Any]:
    """The ``/update_weights_from_tensor`` body of one bucket (fields of SGLang's
    ``UpdateWeightsFromTensorReqInput``): ``serialized`` holds one entry per TP rank (the server's
    rank ``r`` loads ``serialized[r]``), ``load_format`` null (a plain list of ``(name, tensor)``);
    ``flush_cache`` and ``weight_version`` only on the last bucket; never ``abort_all_requests``
    (the samplers are paused with ``abort`` before the first bucket)."""
    return {"serialized_named_tensors": serialized, "load_format": None, "flush_cache": last,
            "abort_all_requests": False, "weight_version": str(version) if last else None}


class WeightSync(Protocol):
    """Learner side of weight publication."""

    def connect(self, sampler_urls: list[str]) -> None: ...
    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...


class _SamplerSet:
    """What both modes share: the samplers in service, those taken out of service, the version
    each holds, and concurrent HTTP calls to them (see :class:`DistributedWeightSync` for the
    attributes).

    Raises:
        WeightSyncError: a pause mode other than those of :data:`PAUSE_MODES`.
    """

    def _out_of_service(self, version: int, bad: list[str]) -> None:
        """Log and raise :class:`WeightSyncError` for the samplers ``bad`` that failed ``version``
        (already in ``self.failed``): out of service, left paused."""
        logger.error("weight version {}: samplers taken out of service (left paused): {}", version,
                     {u: self.failed[u] for u in bad})
        raise WeightSyncError(f"weight version {version} failed on {len(bad)} sampler(s), now out of service "
                              f"(paused, never serving partial weights): {[f'{u}: {self.failed[u]}' for u in bad]}")

    def __init__(self, timeout_s: float, *, bucket_mb: float, pause_mode: str,
                 tp_sizes: Sequence[int] | None = None) -> None:
        if pause_mode not in PAUSE_MODES:
            raise WeightSyncError(f"weight_sync.pause_mode {pause_mode!r} is not supported: use one of {PAUSE_MODES} "
                                  "(the pinned SGLang reports no per-token weight versions)")
        self.timeout_s, self.pause_mode = timeout_s, pause_mode
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.tp_sizes = list(tp_sizes) if tp_sizes is not None else None
        self.urls: list[str] = []
        self.failed: dict[str, str] = {}
        self.held: dict[str, int] = {}  # sampler -> weight version it took from this learner
        self.last_pause_s = 0.0
        self.last_form_s = 0.0
        self._want: list[str] | None = None  # membership asked for by set_members (None: those connected)
        self._members_lock = threading.Lock()
        self._connected = False
        self._pool: ThreadPoolExecutor | None = None

    # ---- live membership (t1async scale sampler.num_samplers, a restarted sampler) ----------
    def set_members(self, urls: list[str]) -> None:
        """The samplers to publish to from now on (thread-safe; the launch's sampler pool calls it
        through the learner). Departed ones leave at the next publish, which re-forms the group
        *before* pausing anyone (the others keep serving during the rendezvous) and never waits
        for them; new ones get weights from :meth:`load` or that publish."""
        with self._members_lock:
            self._want = list(urls)

    def members(self) -> list[str]:
        """Samplers in service to publish to: the last :meth:`set_members` (else those connected)
        less those taken out of service. Forgets failures and versions of departed samplers."""
        with self._members_lock:
            want = list(self._want) if self._want is not None else list(self.urls)
        for d in (self.failed, self.held):
            for u in [u for u in d if u not in want]:
                del d[u]
        return [u for u in want if u not in self.failed]

    def snapshot(self) -> dict[str, Any]:
        """``{"members", "failed", "held"}`` copied for another thread (the learner's status)."""
        for _ in range(5):
            try:
                return {"members": list(self.urls), "failed": dict(self.failed), "held": dict(self.held)}
            except RuntimeError:  # changed size while copied by a publish in the learner's thread
                time.sleep(0.01)
        return {"members": list(self.urls), "failed": {}, "held": {}}

    def joiners(self) -> list[str]:
        """Members that hold no weights from this learner yet (new or restarted samplers)."""
        return [u for u in self.members() if u not in self.held]

    def _ensure_pool(self, n: int) -> None:
        """Worker threads for ``n`` samplers (one blocked call per member, twice over)."""
        if self._pool is None or self._pool._max_workers < 2 * n:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(max_workers=max(8, 2 * n), thread_name_prefix="weight-sync")

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _all(self, path: str, body: dict, urls: list[str]) -> dict[str, str]:
        """POST ``body`` to every url at once; ``{url: error}`` of those that failed."""
        assert self._pool is not None
        futures = {u: self._pool.submit(post_json, u, path, body, timeout_s=self.timeout_s) for u in urls}
        errors = {}
        for u, f in futures.items():
            try:
                res = f.result(timeout=self.timeout_s + 5)
                if isinstance(res, dict) and res.get("success") is False:
                    errors[u] = str(res.get("message"))
            except (SamplerError, FutureTimeout) as e:
                errors[u] = str(e) or type(e).__name__
        return errors


def _collect_answers(futures: dict[str, Any], bucket: int, timeout_s: float, errors: dict[str, str]) -> None:
    """Wait for each sampler's answer to the update of ``bucket`` (futures of
    :func:`~t1async.sampling.sampler_client.post_json`, keyed by URL) and record in ``errors`` every sampler
    that answered ``success: false``, failed or did not answer within ``timeout_s`` (+5 s)."""
    for u, f in futures.items():
        try:
            res = f.result(timeout=timeout_s + 5)
            if not res.get("success", False):
                errors[u] = f"bucket {bucket}: {res.get('message')}"
        except (SamplerError, FutureTimeout) as e:
            errors[u] = f"bucket {bucket}: {e or type(e).__name__}"


class DistributedWeightSync(_SamplerSet):
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
                                     _init_body(self.master_address, port, off, world, self.backend,
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
            _collect_answers(futures, i, self.timeout_s, errors)
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


MODES = ("distributed", "tensor")
"""``weight_sync.mode`` values: :class:`DistributedWeightSync` or :class:`TensorWeightSync`."""


def aligned_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to 64: where the next tensor starts in a staging buffer, so that a
    uint8 slice of it can be viewed as any dtype."""
    return (nbytes + 63) // 64 * 64


class TensorWeightSync(_SamplerSet):
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
            _collect_answers(futures, i, self.timeout_s, errors)
            live = [u for u in live if u not in errors]
            if not live:
                break
        return errors

    def close(self) -> None:
        """Release the worker threads and the staging buffers."""
        self._connected = False
        self._stage = []
        self._close_pool()


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
