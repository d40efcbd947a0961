"""Tensor handles for SGLang's ``/update_weights_from_tensor``: pickles of CUDA IPC or shared-memory handles.

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

The embedded sampler implements the route (t1async/weights/receiver.py), atomically: it loads the pickle with
an exact allow-list of torch's rebuild functions (:func:`deserialize_named_tensors`; SGLang's
prefix list would admit any ``torch.`` callable), checks names, shapes and dtypes (400 naming the
tensor), copies into its receive buffers during the request and swaps all buckets in at the last.
Needs the same machine; launch refuses ``sampler.urls`` on another host. Not run on a GPU yet."""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
from torch.multiprocessing import reductions

from t1async.weights.protocol import WeightSyncError

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
