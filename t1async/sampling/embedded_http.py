"""The embedded sampler's HTTP surface: SGLang's protocol over a threaded stdlib server.

Endpoints (the subset of SGLang 0.5.x that t1async uses; bodies and answers are SGLang's):

- ``POST /generate``: input ids in; output ids, per-token log-probs, routed experts (base64
  int32), finish reason and ``weight_version`` out.
- ``POST /pause_generation``, ``POST /continue_generation``: hold new requests during an update.
- ``GET /model_info`` (``weight_version``), ``GET /health``, ``/flush_cache`` (plain text; 400 while
  a request runs), ``POST /get_weights_by_name``; ``/get_weight_version`` answers 404 as in SGLang 0.5.10.
- the weight-update routes, handled by the routes the caller passes in (an embedded sampler's
  :class:`~t1async.weights.receiver.WeightReceiver`).

Each HTTP thread submits its request to the engine and waits, while the engine thread batches
every in-flight request into one forward per step (continuous batching, t1async/sampling/engine.py).
The engine's ``weight_version`` is the version served (-1: no weights yet, /generate answers 503).
Errors: a malformed body (:class:`RequestError`, any ``ValueError``) is answered 400, a sampler
without weights or draining (:class:`NotReady`) 503, anything else 500 (logged; serving goes on).
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import numpy as np
from loguru import logger

from t1async.config import ModelConfig
from t1async.sampling.engine import Engine, SamplingParams


class RequestError(ValueError):
    """A request body is malformed; answered with HTTP 400 and this message."""


class NotReady(RuntimeError):
    """The sampler cannot serve yet (no weights) or any more (draining, stopped); answered with HTTP 503."""


class SamplerHttp:
    """Serve ``engine`` over HTTP on ``host`` (a free port), from a thread of its own.

    Args:
        engine: the started :class:`~t1async.sampling.engine.Engine`.
        model_cfg: the policy architecture (vocabulary bound of ``input_ids``; ``/model_info``).
        host: the address to bind.
        extra_routes: more ``POST`` routes, path -> handler of the JSON body (the weight updates);
            a handler's answer with ``success`` false is sent with HTTP 400, as SGLang does.
    """

    def __init__(self, engine: Engine, model_cfg: ModelConfig, host: str,
                 extra_routes: dict[str, Callable[[dict], Any]] | None = None):
        self.engine = engine
        self.model_cfg = model_cfg
        self.requests = 0
        self.generated_tokens = 0
        self._stats_lock = threading.Lock()
        self._paused = False  # by /pause_generation (see handle_pause)
        self._pause_lock = threading.Lock()
        self._draining = False  # by drain(): /generate answers 503, so clients go to another sampler
        self._closed = threading.Event()
        self.not_ready = 0  # /generate answered 503 for want of weights (0 when routing is right)
        self.first_request: dict[str, Any] | None = None  # the first answer served: weight version, time
        self.extra_routes = dict(extra_routes or {})
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
                routes = {  # (looked up on the instance at each request)
                    "/generate": sampler.handle_generate,
                    "/pause_generation": sampler.handle_pause,
                    "/continue_generation": sampler.handle_continue,
                    "/get_weights_by_name": sampler.handle_get_weights_by_name,
                    **sampler.extra_routes,
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

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="sampler-http", daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self._url = f"http://{host}:{port}"
        logger.info("embedded sampler serving at {}", self._url)


    @property
    def version(self) -> int:
        """The weight version served (the engine's; -1: none yet)."""
        return self.engine.weight_version

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

    def shutdown(self) -> None:
        """Stop serving (HTTP first, then the engine thread); a second call does nothing."""
        if self._closed.is_set():
            return
        self._server.shutdown()
        self._server.server_close()
        self.engine.stop()
        self._closed.set()
