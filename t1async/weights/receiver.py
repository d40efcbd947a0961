"""The receiving half of the weight protocol: an embedded sampler's weight updates (SGLang's routes).

The sending half is the learner's :class:`~t1async.weights.protocol.WeightSync`
(t1async/weights/distributed.py, t1async/weights/tensor.py). Each update is staged into receive
buffers while generation goes on and swapped in at once, between two requests, when the body
that carries ``weight_version`` (the learner's last bucket) arrives
(:meth:`Engine.between_requests <t1async.sampling.engine.Engine.between_requests>`): a swap never
lands mid-request, a failed update leaves the old weights whole, and every answer's
``weight_version`` covers all its tokens. The HTTP surface (t1async/sampling/embedded_http.py)
routes the requests here; the engine's ``weight_version`` is the version held (-1: none yet).

Routes (bodies and answers are SGLang 0.5.x's): ``/init_weights_update_group``,
``/destroy_weights_update_group``, ``/update_weights_from_distributed``,
``/update_weights_from_tensor``.
"""

from __future__ import annotations

from typing import Any

import torch
from loguru import logger

from t1async.config import WeightSyncConfig
from t1async.models.batch_invariance import column_major_parameters, column_major_view
from t1async.sampling.embedded_http import RequestError
from t1async.weights.group import join_group, leave_group
from t1async.weights.handles import deserialize_named_tensors
from t1async.weights.tensor import aligned_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The float dtypes a sampler holds and receives, by the names the protocol sends."""


class WeightReceiver:
    """Receive weight updates into an engine (SGLang's update routes, atomic swaps).

    Args:
        engine: the :class:`~t1async.sampling.engine.Engine` whose ``model`` parameters are
            replaced; the engine's ``weight_version`` is set at each swap.
        label: how log lines name this sampler (its URL once served).
    """

    def __init__(self, engine: Any, label: str = "embedded"):
        self.engine = engine
        self.label = label
        # the engine keeps these column-major (Engine docstring: Layout); receive buffers are laid out alike so a
        # swap keeps the layout without a copy inside the pause
        self._column_major = set(column_major_parameters(engine.model))
        self._wire = torch.empty(0, dtype=torch.uint8)  # a flattened bucket as broadcast, before its re-layout
        self._group = None
        self._staged: dict[str, torch.Tensor] = {}  # received, not yet swapped in (see handle_update_weights)
        # flattened-bucket receive buffers, two sets used in turn (see _recv_buffer)
        self._recv_pools: list[list[torch.Tensor]] = [[], []]
        self._recv_side = 0
        self._recv_next = 0

    @property
    def version(self) -> int:
        """The weight version the engine holds (-1: none yet)."""
        return self.engine.weight_version

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """In-process weight swap (tools and tests that run without a broadcast group): copy
        ``state_dict`` (HF names; cast to the sampler's dtype) between requests, flush the prefix
        cache and take ``version``.

        Raises:
            RuntimeError: missing or unexpected parameter names (strict load).
        """
        with self.engine.between_requests(), torch.no_grad():
            self.engine.model.load_state_dict(state_dict, strict=True)
            self.engine.flush_cache()
            self.engine.weight_version = int(version)

    def handle_init_group(self, body: dict) -> dict:
        """SGLang ``/init_weights_update_group``: join the learner's broadcast group as rank
        ``rank_offset`` (tensor parallelism 1) with SGLang's recipe (:func:`join_group`).

        The group's timeout (rendezvous and every later broadcast, seconds) is the body's
        ``timeout_s``, a t1async extension the learner fills from ``weight_sync.timeout_s`` for
        embedded samplers (so one setting governs both ends); absent, the ``weight_sync.timeout_s`` default.

        Raises:
            RequestError: a required field is missing or ``timeout_s`` is not a positive number.
        """
        timeout_s = body.get("timeout_s", WeightSyncConfig().timeout_s)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise RequestError(f"init_weights_update_group timeout_s must be a positive number of seconds, got {timeout_s!r}")
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            raise RequestError(f"init_weights_update_group needs field(s) {missing}")
        if self._group is not None:
            leave_group(self._group)
            self._group = None
        self._staged.clear()
        self._recv_next = 0
        try:
            self._group = join_group(body.get("backend", "nccl"), body["master_address"], int(body["master_port"]),
                                     int(body["rank_offset"]), int(body["world_size"]),
                                     body.get("group_name", "weight_update_group"), float(timeout_s))
        except Exception as e:
            return {"success": False, "message": f"Failed to initialize custom process group: {e}."}
        return {"success": True, "message": f"joined as rank {body['rank_offset']}"}

    def _recv_buffer(self, nbytes: int) -> torch.Tensor:
        """uint8 [nbytes] receive buffer for the next bucket of this update.

        Two sets of buffers take turns: a full update of matching dtypes is swapped in by making
        each parameter a view into its bucket (no copy inside the pause), and the set that held
        the previous weights receives the next update (warm memory: no page faults while the
        broadcast runs). Otherwise the swap copies and the set stays the receiving one."""
        pool = self._recv_pools[self._recv_side]
        i = self._recv_next
        self._recv_next += 1
        if i == len(pool):
            pool.append(torch.empty(0, dtype=torch.uint8))
        if pool[i].numel() != nbytes:
            pool[i] = torch.empty(nbytes, dtype=torch.uint8)
        return pool[i]

    def _receive_view(self, flat: torch.Tensor, name: str, shape) -> torch.Tensor:
        """``flat`` (a 1-D receive buffer of ``prod(shape)`` elements) as a ``shape`` tensor in the layout the engine
        keeps parameter ``name`` in (column-major for its matmul weights)."""
        if name in self._column_major and len(shape) >= 2:
            return column_major_view(flat, tuple(shape))
        return flat.view(shape)

    def handle_destroy_group(self, body: dict) -> dict:
        """SGLang ``/destroy_weights_update_group``: leave the group (``success`` false, HTTP 400,
        when there is none)."""
        if self._group is None:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        leave_group(self._group)
        self._group = None
        self._staged.clear()
        self._recv_next = 0
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def handle_update_weights(self, body: dict) -> dict:
        """SGLang ``/update_weights_from_distributed``: receive the broadcast tensors (one per
        tensor, or one uint8 tensor with ``load_format: "flattened_bucket"``) into staging
        buffers. The staged tensors are swapped in together, between requests, when a request
        carries ``weight_version`` (the learner's last bucket), so the embedded sampler is
        atomic: a failed update leaves the old weights whole.

        Returns:
            ``{"success", "message"}``; ``success`` false (HTTP 400) on a failed receive or a
            name or shape the model does not have (everything staged is then dropped).

        Raises:
            RequestError: no group yet, or ``names``/``dtypes``/``shapes`` missing or of unequal length.
        """
        if self._group is None:
            raise RequestError("call /init_weights_update_group before /update_weights_from_distributed")
        try:
            names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        except KeyError as e:
            raise RequestError(f"update_weights_from_distributed needs field {e.args[0]!r}") from None
        if not len(names) == len(dtypes) == len(shapes):
            raise RequestError("names, dtypes and shapes must have equal lengths")
        if any(dt not in DTYPES for dt in dtypes):
            raise RequestError(f"dtypes must be among {sorted(DTYPES)}, got {sorted(set(dtypes) - set(DTYPES))}")
        params = dict(self.engine.model.named_parameters())
        try:
            if body.get("load_format") == "flattened_bucket":
                sizes = [torch.Size(shape).numel() * DTYPES[dt].itemsize for dt, shape in zip(dtypes, shapes)]
                if self._wire.numel() != sum(sizes):
                    self._wire = torch.empty(sum(sizes), dtype=torch.uint8)
                self._group.broadcast(self._wire, 0).wait()
                flat = self._recv_buffer(sum(sizes))
                bufs, off = [], 0
                for name, dt, shape, n in zip(names, dtypes, shapes, sizes):  # into the engine's layout
                    bufs.append(self._receive_view(flat[off:off + n].view(DTYPES[dt]), name, shape))
                    bufs[-1].copy_(self._wire[off:off + n].view(DTYPES[dt]).view(shape))
                    off += n
            else:
                bufs = [torch.empty(shape, dtype=DTYPES[dt]) for dt, shape in zip(dtypes, shapes)]
                for b in bufs:  # every tensor is received, even a bad one, to keep the group in step
                    self._group.broadcast(b, 0).wait()
        except Exception as e:
            self._staged.clear()
            self._recv_next = 0
            return {"success": False, "message": f"Failed to update parameter online: {e}. Nothing was swapped in."}
        bad = [n for n, b in zip(names, bufs) if n not in params or tuple(params[n].shape) != tuple(b.shape)]
        if bad:
            self._staged.clear()
            self._recv_next = 0
            return {"success": False, "message": f"unknown or misshapen parameters: {bad[:5]}"}
        self._staged.update(zip(names, bufs))
        if body.get("weight_version") is None:
            return {"success": True, "message": f"staged {len(self._staged)} tensors"}
        return self._swap_staged(params, body["weight_version"])

    def _swap_staged(self, params: dict[str, torch.nn.Parameter], version: Any) -> dict:
        """Swap every staged tensor in at once, between requests, and take ``version``."""
        full = set(self._staged) == set(params) and all(b.dtype == params[n].dtype for n, b in self._staged.items())
        with self.engine.between_requests(), torch.no_grad():  # in-flight requests finish first
            for name, buf in self._staged.items():
                if full:
                    params[name].data = buf  # a view into this update's receive buffers
                else:
                    params[name].copy_(buf)  # (casts to the sampler's dtype)
            if full:
                self._recv_side = 1 - self._recv_side  # the previous weights' buffers receive next
            self.engine.flush_cache()  # cached prefixes hold the old weights' KV and routing
            self.engine.weight_version = int(version)
        n = len(self._staged)
        self._staged.clear()
        self._recv_next = 0
        logger.info("sampler {} now holds weight version {} ({} tensors)", self.label, self.version, n)
        return {"success": True, "message": f"Succeeded to update parameter online. Weight version updated to {self.version}."}

    def handle_update_weights_from_tensor(self, body: dict) -> dict:
        """SGLang ``/update_weights_from_tensor``: ``serialized_named_tensors[0]`` (this sampler is
        TP rank 0 of 1) is a pickle of ``[(name, tensor), ...]`` whose tensors are handles to the
        sender's memory (CUDA IPC or named shared memory; t1async.weights.handles
        ``serialize_named_tensors``), loaded through an allow-list of torch's rebuild functions.
        Each tensor is checked against the model (name, shape, a float dtype) and copied, during
        the request, into this update's receive buffers in the model's dtype; nothing is kept that
        points into the sender's memory. As for ``/update_weights_from_distributed``, everything is
        staged until the body that carries ``weight_version`` (the learner's last bucket), then
        swapped in at once between requests (atomic): a refused bucket drops everything staged and
        the old weights stay whole. ``flush_cache`` and ``abort_all_requests`` need nothing here
        (the prefix cache is flushed on every swap; the learner pauses with ``abort`` first).

        Returns:
            ``{"success", "message"}``; ``success`` false (HTTP 400) naming the first bad tensor, or
            when the payload cannot be opened (another machine, memory already released).

        Raises:
            RequestError: ``serialized_named_tensors`` missing or empty, or a ``load_format`` other
                than null.
        """
        def drop_staged() -> None:  # a refused bucket ends the update: nothing staged may be swapped in later
            self._staged.clear()
            self._recv_next = 0

        def refuse(message: str) -> dict:
            drop_staged()
            return {"success": False, "message": f"{message}. Nothing was swapped in: the sampler keeps weight "
                                                 f"version {self.version} whole."}

        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries or not isinstance(entries[0], (str, bytes)):
            drop_staged()
            raise RequestError("update_weights_from_tensor needs serialized_named_tensors: one base64 string "
                               "per TP rank")
        if body.get("load_format") is not None:
            drop_staged()
            raise RequestError(f"load_format {body['load_format']!r} is not supported by the embedded sampler: "
                               "send null (a list of (name, tensor))")
        params = dict(self.engine.model.named_parameters())

        try:
            named = deserialize_named_tensors(entries[0])
        except Exception as e:
            return refuse(f"cannot open serialized_named_tensors[0]: {type(e).__name__}: {e}")
        if not isinstance(named, (list, tuple)):
            return refuse(f"serialized_named_tensors[0] holds a {type(named).__name__}, not a list of (name, tensor)")
        for k, item in enumerate(named):
            if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                return refuse(f"entry {k} of serialized_named_tensors[0] is not a (name, tensor) pair")
            name, t = item
            if name not in params:
                return refuse(f"tensor {name!r}: the model has no such parameter")
            if tuple(t.shape) != tuple(params[name].shape):
                return refuse(f"tensor {name!r}: shape {list(t.shape)}, the model's is {list(params[name].shape)}")
            if t.dtype not in DTYPES.values():
                return refuse(f"tensor {name!r}: dtype {str(t.dtype).removeprefix('torch.')}, not one of "
                              f"{sorted(DTYPES)}")
        dtypes = [params[name].dtype for name, _ in named]
        sizes = [t.numel() * dt.itemsize for (_, t), dt in zip(named, dtypes)]
        flat = self._recv_buffer(sum(aligned_bytes(n) for n in sizes))
        bufs, off = [], 0
        with torch.no_grad():
            for (name, t), dt, n in zip(named, dtypes, sizes):
                buf = self._receive_view(flat[off:off + n].view(dt), name, tuple(t.shape))
                buf.copy_(t)  # out of the sender's memory (and onto this device, in the model's dtype and layout)
                bufs.append(buf)
                off += aligned_bytes(n)
        self._staged.update((name, b) for (name, _), b in zip(named, bufs))
        del named
        if body.get("weight_version") is None:
            return {"success": True, "message": f"staged {len(self._staged)} tensors"}
        return self._swap_staged(params, body["weight_version"])
