"""Sampler role: the embedded PyTorch engine behind an HTTP server that speaks SGLang's protocol.

Endpoints (the subset of SGLang 0.5.x that t1async uses; bodies and answers are SGLang's):

- ``POST /generate``: input ids in; output ids, per-token log-probs, routed experts (base64
  int32), finish reason and ``weight_version`` out.
- ``POST /init_weights_update_group``: join the learner's torch.distributed broadcast group.
- ``POST /update_weights_from_distributed``: receive every tensor the learner broadcasts into
  staging buffers, then swap them in between two requests and take the new version.
- ``GET /get_weight_version``, ``GET /health``, ``POST /flush_cache`` (drops the engine's prefix cache).

Data path: rollout actors call /generate; each HTTP thread submits its request to the engine and
waits, while the engine thread batches every in-flight request into one forward per step
(continuous batching, t1async/engine.py). The learner calls /update_weights_from_distributed: the
broadcast runs while generation continues, the swap inside ``Engine.between_requests`` (admission
paused, in-flight requests finished first), so a swap never lands mid-request and every answer's
``weight_version`` covers all its tokens. Stopped by :meth:`shutdown`.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch
from loguru import logger

from t1async.config import ModelConfig, SamplerConfig, WeightSyncConfig
from t1async.engine import Engine, SamplingParams
from t1async.model import Qwen3MoeForCausalLM
from t1async.weight_sync import init_weight_group

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
        model = Qwen3MoeForCausalLM(model_cfg).to(_DTYPES[cfg.dtype]).eval()
        self.engine = Engine(model, seed=seed, prefix_cache=cfg.prefix_cache, prefill_chunk=cfg.prefill_chunk,
                             max_batch=cfg.max_batch)
        self.version = -1
        self.engine.weight_version = -1
        self.engine.start()
        self.requests = 0
        self.generated_tokens = 0
        self._stats_lock = threading.Lock()
        self._group = None
        sampler = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:  # route http.server's log to loguru
                logger.trace("sampler http: " + fmt, *args)

            def _reply(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._reply(200, {"ok": True})
                elif self.path == "/get_weight_version":
                    self._reply(200, {"weight_version": str(sampler.version)})
                else:
                    self._reply(404, {"error": f"no GET route {self.path}"})

            def do_POST(self) -> None:
                routes = {
                    "/generate": sampler.handle_generate,
                    "/init_weights_update_group": sampler.handle_init_group,
                    "/update_weights_from_distributed": sampler.handle_update_weights,
                    "/flush_cache": sampler.handle_flush_cache,
                }
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(n) or b"{}")
                    if self.path not in routes:
                        self._reply(404, {"error": f"no POST route {self.path}"})
                        return
                    self._reply(200, routes[self.path](body))
                except (RequestError, json.JSONDecodeError, ValueError) as e:
                    self._reply(400, {"error": str(e)})
                except NotReady as e:
                    self._reply(503, {"error": str(e)})
                except Exception as e:  # keep serving; report the failure to the caller
                    logger.exception("sampler request {} failed", self.path)
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

    def stats(self) -> dict[str, int]:
        """Weight version held, requests served, tokens generated, seconds the engine spent in
        forwards (``busy_s``), prefix-cache hits and the prompt tokens they did not recompute,
        packed forwards run and the sequences they carried."""
        e = self.engine
        return {"weight_version": self.version, "requests": self.requests, "generated_tokens": self.generated_tokens,
                "busy_s": round(e.busy_s, 3), "prefix_cache_hits": e.cache_hits, "prefix_cached_tokens": e.cached_tokens,
                "forwards": e.forwards, "forward_sequences": e.forward_sequences}

    def handle_flush_cache(self, body: dict) -> dict:
        """SGLang ``/flush_cache``: drop every cached prefix (between forwards; requests in flight
        keep their own KV)."""
        self.engine.flush_cache()
        return {"success": True}

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
            NotReady: no weights received yet.
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
        if self.version < 0:
            raise NotReady("no weights loaded yet: the learner has not published version 0")
        out = self.engine.submit(ids, params, routed_experts_start_len=start).result()
        version = out.weight_version  # the weights every token of this answer came from
        with self._stats_lock:
            self.requests += 1
            self.generated_tokens += len(out.output_ids)
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
        """SGLang ``/init_weights_update_group``: join the learner's broadcast group as ``rank_offset``.

        The group's timeout (rendezvous and every later broadcast, seconds) is the body's
        ``timeout_s``, a t1async extension the learner fills from ``weight_sync.timeout_s`` (so one
        setting governs both ends); absent (another client), the ``weight_sync.timeout_s`` default.

        Raises:
            RequestError: a required field is missing or ``timeout_s`` is not a positive number.
        """
        timeout_s = body.get("timeout_s", WeightSyncConfig().timeout_s)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise RequestError(f"init_weights_update_group timeout_s must be a positive number of seconds, got {timeout_s!r}")
        try:
            self._group = init_weight_group(
                body["backend"], body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
                int(body["world_size"]), body["group_name"], float(timeout_s),
            )
        except KeyError as e:
            raise RequestError(f"init_weights_update_group needs field {e.args[0]!r}") from None
        return {"success": True, "message": f"joined as rank {body['rank_offset']}"}

    def handle_update_weights(self, body: dict) -> dict:
        """SGLang ``/update_weights_from_distributed``: receive all tensors, swap between requests.

        Raises:
            RequestError: the group is not initialised or a name/shape does not match the model.
        """
        if self._group is None:
            raise RequestError("call /init_weights_update_group before /update_weights_from_distributed")
        params = dict(self.engine.model.named_parameters())
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        staged = []
        for name, dt, shape in zip(names, dtypes, shapes):
            buf = torch.empty(shape, dtype=_DTYPES.get(dt, torch.float32))
            self._group.broadcast(buf, 0).wait()  # every tensor is received, even a bad one, to keep the group in step
            staged.append((name, buf))
        bad = [n for n, b in staged if n not in params or tuple(params[n].shape) != tuple(b.shape)]
        if bad:
            return {"success": False, "message": f"unknown or misshapen parameters: {bad[:5]}"}
        with self.engine.between_requests(), torch.no_grad():  # in-flight requests finish first
            for name, buf in staged:
                params[name].copy_(buf)
            self.engine.flush_cache()  # cached prefixes hold the old weights' KV and routing
            self.version = self.engine.weight_version = int(body.get("weight_version", self.version + 1))
        logger.info("sampler {} now holds weight version {}", self._url, self.version)
        return {"success": True, "message": f"version {self.version}"}

    def shutdown(self) -> None:
        """Stop serving (HTTP first, then the engine thread)."""
        self._server.shutdown()
        self._server.server_close()
        self.engine.stop()


class NotReady(RuntimeError):
    """The sampler cannot serve yet (no weights); answered with HTTP 503."""
