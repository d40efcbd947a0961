"""Sampler role: the embedded PyTorch engine behind an HTTP server that speaks SGLang's protocol.

Endpoints (the subset of SGLang 0.5.x that t1async uses; bodies and answers are SGLang's):

- ``POST /generate``: input ids in; output ids, per-token log-probs, routed experts (base64
  int32), finish reason and ``weight_version`` out.
- ``POST /init_weights_update_group``: join the learner's torch.distributed broadcast group.
- ``POST /update_weights_from_distributed``: receive every tensor the learner broadcasts into
  staging buffers, then swap them in between two requests and take the new version.
- ``POST /update_weights_from_tensor``: the same from a learner on this machine, each bucket as
  handles to its memory (CUDA IPC or named shared memory), copied into staging buffers during the
  request; swapped in as above.
- ``POST /pause_generation``, ``POST /continue_generation``: hold new requests during an update.
- ``GET /model_info`` (``weight_version``), ``GET /health``, ``/flush_cache`` (plain text; 400 while
  a request runs), ``POST /get_weights_by_name``; ``/get_weight_version`` answers 404 as in SGLang 0.5.10.

Data path: rollout actors call /generate; each HTTP thread submits its request to the engine and
waits, while the engine thread batches every in-flight request into one forward per step
(continuous batching, t1async/sampling/engine.py). The learner calls /update_weights_from_distributed: the
broadcast runs while generation continues, the swap inside ``Engine.between_requests`` (admission
paused, in-flight requests finished first), so a swap never lands mid-request and every answer's
``weight_version`` covers all its tokens. Stopped by :meth:`shutdown`.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch
from loguru import logger

from t1async.config import ModelConfig, SamplerConfig, WeightSyncConfig
from t1async.models.batch_invariance import column_major_parameters, column_major_view
from t1async.models.families import build_model
from t1async.sampling.engine import Engine, SamplingParams
from t1async.weights.group import join_group, leave_group
from t1async.weights.handles import deserialize_named_tensors
from t1async.weights.tensor import aligned_bytes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RequestError(ValueError):
    """A request body is malformed; answered with HTTP 400 and this message."""


class EmbeddedSampler:
    """One embedded sampler: a Qwen3-MoE engine served over HTTP on ``cfg.host`` (a free port).

    Args:
        model_cfg: the policy architecture (weights arrive from the learner; until the first
            update the sampler answers /generate with HTTP 503).
        cfg: sampler settings (host, dtype).
        seed: seed of the engine's sampling RNG.
        torch_threads: intra-op threads for this process.
    """

    def __init__(self, model_cfg: ModelConfig, cfg: SamplerConfig, *, seed: int = 0, torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        if cfg.dtype not in _DTYPES:
            raise ValueError(f"sampler.dtype {cfg.dtype!r} is not one of {sorted(_DTYPES)}")
        self.model_cfg = model_cfg
        model = build_model(model_cfg).to(_DTYPES[cfg.dtype]).eval()  # the weights arrive from the learner
        self.engine = Engine(model, seed=seed, prefix_cache=cfg.prefix_cache, prefill_chunk=cfg.prefill_chunk,
                             max_batch=cfg.max_batch)
        self.version = -1
        self.engine.weight_version = -1
        # the engine keeps these column-major (Engine docstring: Layout); receive buffers are laid out alike so a
        # swap keeps the layout without a copy inside the pause
        self._column_major = set(column_major_parameters(model))
        self._wire = torch.empty(0, dtype=torch.uint8)  # a flattened bucket as broadcast, before its re-layout
        self.engine.start()
        self.requests = 0
        self.generated_tokens = 0
        self._stats_lock = threading.Lock()
        self._group = None
        self._staged: dict[str, torch.Tensor] = {}  # received, not yet swapped in (see handle_update_weights)
        # flattened-bucket receive buffers, two sets used in turn (see _recv_buffer)
        self._recv_pools: list[list[torch.Tensor]] = [[], []]
        self._recv_side = 0
        self._recv_next = 0
        self._paused = False  # by /pause_generation (see handle_pause)
        self._pause_lock = threading.Lock()
        self._draining = False  # by drain(): /generate answers 503, so clients go to another sampler
        self._closed = threading.Event()
        self.not_ready = 0  # /generate answered 503 for want of weights (0 when routing is right)
        self.first_request: dict[str, Any] | None = None  # the first answer served: weight version, time
        sampler = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:  # route http.server's log to loguru
                logger.trace("sampler http: " + fmt, *args)

            def _reply(self, status: int, obj: Any) -> None:
                text = isinstance(obj, str)  # SGLang answers /flush_cache in plain text
                data = obj.encode() if text else json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=utf-8" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path in ("/health", "/health_generate"):
                    self._reply(200 if sampler.version >= 0 else 503, {})
                elif path == "/model_info":
                    self._reply(200, sampler.model_info())
                elif path == "/server_info":
                    self._reply(200, {"tp_size": 1, "version": "t1async-embedded"})
                elif path in ("/get_weight_version", "/weight_version"):  # retired in SGLang 0.5.10
                    self._reply(404, {"detail": "Endpoint '/get_weight_version' is deprecated. "
                                                "Please use '/model_info' instead."})
                elif path == "/flush_cache":
                    self._reply(*sampler.handle_flush_cache({}))
                else:
                    self._reply(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                routes = {
                    "/generate": sampler.handle_generate,
                    "/init_weights_update_group": sampler.handle_init_group,
                    "/update_weights_from_distributed": sampler.handle_update_weights,
                    "/update_weights_from_tensor": sampler.handle_update_weights_from_tensor,
                    "/destroy_weights_update_group": sampler.handle_destroy_group,
                    "/pause_generation": sampler.handle_pause,
                    "/continue_generation": sampler.handle_continue,
                    "/get_weights_by_name": sampler.handle_get_weights_by_name,
                }
                path = self.path.split("?", 1)[0]
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(n) or b"{}")
                    if path == "/flush_cache":
                        self._reply(*sampler.handle_flush_cache(body))
                        return
                    if path not in routes:
                        self._reply(404, {"detail": "Not Found"})
                        return
                    if not isinstance(body, dict):
                        raise RequestError(f"{path} takes a JSON object")
                    out = routes[path](body)
                    failed = isinstance(out, dict) and out.get("success") is False
                    self._reply(400 if failed else 200, out)  # SGLang answers a failed update with 400
                except (RequestError, json.JSONDecodeError, ValueError) as e:
                    self._reply(400, {"error": str(e)})
                except NotReady as e:
                    self._reply(503, {"error": str(e)})
                except Exception as e:  # keep serving; report the failure to the caller
                    logger.exception("sampler request {} failed", path)
                    self._reply(500, {"error": f"{type(e).__name__}: {e}"})

        self._server = ThreadingHTTPServer((cfg.host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="sampler-http", daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self._url = f"http://{host}:{port}"
        logger.info("embedded sampler serving at {}", self._url)

    def url(self) -> str:
        """Base URL of this sampler's HTTP server."""
        return self._url

    def stats(self) -> dict[str, Any]:
        """Weight version held, requests served, tokens generated, seconds the engine spent in
        forwards (``busy_s``), prefix-cache hits and the prompt tokens they did not recompute,
        packed forwards run and the sequences they carried, requests refused for want of weights
        (``not_ready``), the first answer served (``first_request``: ``weight_version``, ``at``
        wall-clock seconds), requests running now (``in_flight``) and the process id."""
        e = self.engine
        return {"weight_version": self.version, "requests": self.requests, "generated_tokens": self.generated_tokens,
                "busy_s": round(e.busy_s, 3), "prefix_cache_hits": e.cache_hits, "prefix_cached_tokens": e.cached_tokens,
                "forwards": e.forwards, "forward_sequences": e.forward_sequences, "not_ready": self.not_ready,
                "first_request": self.first_request, "in_flight": e.in_flight, "pid": os.getpid()}

    def drain(self, timeout_s: float = 30.0) -> int:
        """Stop taking requests (``/generate`` answers 503: a rollout actor sends it to another
        sampler) and wait up to ``timeout_s`` for the running ones to finish; returns how many
        still ran at the end (0: drained)."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self.engine.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.engine.in_flight

    def wait_closed(self) -> None:
        """Return when :meth:`shutdown` ran (the launch's sampler pool waits on this call: it
        fails at once when the actor dies)."""
        self._closed.wait()

    def model_info(self) -> dict[str, Any]:
        """SGLang ``GET /model_info``: where newer SGLang reports ``weight_version`` (a string)."""
        mc = self.model_cfg
        # model_path "t1async-embedded" is how weight sync tells this engine from an SGLang server
        return {"model_path": "t1async-embedded", "tokenizer_path": mc.path or None, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": str(self.version),
                "model_type": mc.model_type,
                "architectures": mc.hf_config.get("architectures") or ["Qwen3MoeForCausalLM"]}

    def handle_flush_cache(self, body: dict) -> tuple[int, str]:
        """SGLang ``/flush_cache``: drop every cached prefix. Answers plain text, as SGLang does:
        200 when flushed, 400 while a request is queued or running (nothing is flushed then)."""
        if self.engine.in_flight:
            return 400, "Flush cache failed: requests are running.\n"
        self.engine.flush_cache()
        return 200, "Cache flushed.\n"

    def handle_pause(self, body: dict) -> dict:
        """SGLang ``/pause_generation {mode}``: new /generate requests queue until
        ``/continue_generation``. Mode ``abort`` aborts running requests in SGLang; here the
        running requests finish their answers first (:meth:`Engine.pause`), so either way
        nothing runs when the call returns. A second pause while paused is a no-op.

        Raises:
            RequestError: a mode other than abort, retract, in_place.
        """
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        with self._pause_lock:
            if not self._paused:
                self.engine.pause()
                self._paused = True
        return {"message": "Generation paused successfully.", "status": "ok"}

    def handle_continue(self, body: dict) -> dict:
        """SGLang ``/continue_generation``: release the requests held by a pause (a no-op when
        not paused)."""
        with self._pause_lock:
            if self._paused:
                self.engine.resume()
                self._paused = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    def handle_get_weights_by_name(self, body: dict) -> list:
        """SGLang ``/get_weights_by_name {name, truncate_size}``: the first ``truncate_size`` values
        of the flattened parameter (tests compare weights through it).

        Raises:
            RequestError: unknown parameter name.
        """
        params = dict(self.engine.model.named_parameters())
        name = body.get("name")
        if name not in params:
            raise RequestError(f"no parameter named {name!r}")
        return params[name].detach().float().flatten()[: int(body.get("truncate_size", 100))].tolist()

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
            self.version = self.engine.weight_version = int(version)

    def handle_generate(self, body: dict) -> dict:
        """SGLang ``/generate`` (single request, ``input_ids`` form).

        Raises:
            RequestError: missing or malformed ``input_ids`` / ``sampling_params``.
            NotReady: no weights received yet, or the sampler is draining (scaled down) or stopped.
        """
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise RequestError("input_ids must be a non-empty list of ints (text prompts are not supported)")
        if any(i < 0 or i >= self.model_cfg.vocab_size for i in ids):
            raise RequestError(f"input_ids must lie in [0, {self.model_cfg.vocab_size})")
        sp = body.get("sampling_params") or {}
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed"}
        unknown = set(sp) - known
        if unknown:
            raise RequestError(f"unsupported sampling_params {sorted(unknown)}; supported: {sorted(known)}")
        params = SamplingParams(**sp)
        start = int(body.get("routed_experts_start_len", 0))
        if self._draining or self._closed.is_set():
            raise NotReady("this sampler is draining (scaled down) or stopped: send the request to another one")
        if self.version < 0:
            with self._stats_lock:
                self.not_ready += 1
            raise NotReady("no weights loaded yet: the learner has not published version 0")
        out = self.engine.submit(ids, params, routed_experts_start_len=start).result()
        version = out.weight_version  # the weights every token of this answer came from
        with self._stats_lock:
            self.requests += 1
            self.generated_tokens += len(out.output_ids)
            if self.first_request is None:
                self.first_request = {"weight_version": version, "at": time.time()}
        meta: dict[str, Any] = {
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(out.output_logprobs, out.output_ids)],
            "finish_reason": out.finish_reason,
            "weight_version": str(version),
            "prompt_tokens": len(ids),
            "completion_tokens": len(out.output_ids),
        }
        if body.get("return_routed_experts"):
            meta["routed_experts"] = base64.b64encode(np.ascontiguousarray(out.routed_experts, dtype="<i4").tobytes()).decode()
        return {"output_ids": out.output_ids, "meta_info": meta}

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
        if any(dt not in _DTYPES for dt in dtypes):
            raise RequestError(f"dtypes must be among {sorted(_DTYPES)}, got {sorted(set(dtypes) - set(_DTYPES))}")
        params = dict(self.engine.model.named_parameters())
        try:
            if body.get("load_format") == "flattened_bucket":
                sizes = [torch.Size(shape).numel() * _DTYPES[dt].itemsize for dt, shape in zip(dtypes, shapes)]
                if self._wire.numel() != sum(sizes):
                    self._wire = torch.empty(sum(sizes), dtype=torch.uint8)
                self._group.broadcast(self._wire, 0).wait()
                flat = self._recv_buffer(sum(sizes))
                bufs, off = [], 0
                for name, dt, shape, n in zip(names, dtypes, shapes, sizes):  # into the engine's layout
                    bufs.append(self._receive_view(flat[off:off + n].view(_DTYPES[dt]), name, shape))
                    bufs[-1].copy_(self._wire[off:off + n].view(_DTYPES[dt]).view(shape))
                    off += n
            else:
                bufs = [torch.empty(shape, dtype=_DTYPES[dt]) for dt, shape in zip(dtypes, shapes)]
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
            self.version = self.engine.weight_version = int(version)
        n = len(self._staged)
        self._staged.clear()
        self._recv_next = 0
        logger.info("sampler {} now holds weight version {} ({} tensors)", self._url, self.version, n)
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
            if t.dtype not in _DTYPES.values():
                return refuse(f"tensor {name!r}: dtype {str(t.dtype).removeprefix('torch.')}, not one of "
                              f"{sorted(_DTYPES)}")
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

    def shutdown(self) -> None:
        """Stop serving (HTTP first, then the engine thread); a second call does nothing."""
        if self._closed.is_set():
            return
        self._server.shutdown()
        self._server.server_close()
        self.engine.stop()
        self._closed.set()


class NotReady(RuntimeError):
    """The sampler cannot serve yet (no weights); answered with HTTP 503."""
