"""Buckets: the policy's tensors in publish order, packed into flattened buckets of at most
``bucket_mb``, and the bodies of SGLang's update requests that describe them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from t1async.weights.group import GROUP_NAME
from t1async.weights.protocol import WeightSyncError


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
    against the pinned release's dataclasses by tests/contracts/test_sglang_conformance.py)."""
    b = plan_buckets([("w", torch.zeros(2))], 1 << 20)[0]
    return {
        "/init_weights_update_group": init_body("127.0.0.1", 1, 1, 2, "gloo", None),
        "/destroy_weights_update_group": {"group_name": GROUP_NAME},
        "/pause_generation": {"mode": "abort"},
        "/update_weights_from_distributed": update_body(b, last=True, version=3),
        "/update_weights_from_tensor": tensor_update_body(["e30="], last=True, version=3),
        "/continue_generation": {},
    }


def init_body(address: str, port: int, rank_offset: int, world: int, backend: str,
               timeout_s: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {"master_address": address, "master_port": port, "rank_offset": rank_offset,
                            "world_size": world, "group_name": GROUP_NAME, "backend": backend}
    if timeout_s is not None:
        body["timeout_s"] = timeout_s  # embedded samplers only (not a field of SGLang's request)
    return body


def tensor_update_body(serialized: list[str], *, last: bool, version: int) -> dict[str, Any]:
    """The ``/update_weights_from_tensor`` body of one bucket (fields of SGLang's
    ``UpdateWeightsFromTensorReqInput``): ``serialized`` holds one entry per TP rank (the server's
    rank ``r`` loads ``serialized[r]``), ``load_format`` null (a plain list of ``(name, tensor)``);
    ``flush_cache`` and ``weight_version`` only on the last bucket; never ``abort_all_requests``
    (the samplers are paused with ``abort`` before the first bucket)."""
    return {"serialized_named_tensors": serialized, "load_format": None, "flush_cache": last,
            "abort_all_requests": False, "weight_version": str(version) if last else None}
