"""A fake SGLang server for CPU tests: the edge that cannot run here (SGLang needs a GPU), built from the
committed fixture of the pinned release (tests/fixtures/sglang_schema.json).

What is real: HTTP (a threaded stdlib server, like t1async/actors/sampler.py), the routes and methods the
fixture lists, request validation against the release's dataclasses (missing required field: 422;
stricter than SGLang, an unknown field is 422 too, so a typo never passes silently), the answer
shapes (``meta_info`` with ``finish_reason`` dict, ``output_token_logprobs`` ``[logprob, id, null]``,
``weight_version`` string, base64 int32 ``routed_experts`` only with the server flag, plain-text
``/flush_cache`` that answers 400 while requests run, ``/get_weight_version`` 404, abort on
``/pause_generation``), and the weight-update group: each of ``tp_size`` worker *processes* joins
with SGLang's own recipe (``tcp://`` rendezvous, ``PrefixStore(group_name, store)``, torch's
``_new_process_group_helper``, rank ``rank_offset + tp_rank``) and receives every broadcast
(``flattened_bucket`` or one tensor per name), applying each bucket at once like SGLang (not atomic).
``/update_weights_from_tensor`` needs one ``serialized_named_tensors`` entry per TP rank; each worker
decodes its own entry (``[tp_rank]``, base64, an unpickler with the release's ``SafeUnpickler``
allow-list), so CPU shared-memory handles are really opened by another process, copies the
``(name, tensor)`` list and the ranks must agree byte for byte. CUDA IPC payloads are not exercised
(CPU only; the release's receiver also maps a GPU UUID in the device slot back to an index).

What is fake: generation. Tokens, log-probs and routing come from a seeded RNG, one token every
``token_delay_s``, not from the received weights.
"""

from __future__ import annotations

import base64
import hashlib
import json
import multiprocessing as mp
import pickle
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from tests.support import FIXTURES

SCHEMA_PATH = FIXTURES / "sglang_schema.json"


def _tp_worker(conn, tp_rank: int, group_timeout_s: float) -> None:
    """One TP rank of the fake server: joins the update group with SGLang's recipe and receives
    broadcasts; commands arrive on ``conn`` as ``(op, kwargs)``, answers go back as dicts."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    groups: dict[str, Any] = {}
    weights: dict[str, torch.Tensor] = {}
    while True:
        op, kw = conn.recv()
        try:
            if op == "stop":
                conn.send({"success": True})
                return
            if op == "init":
                # SGLang model_runner.init_weights_update_group + utils.init_custom_process_group
                timeout = datetime.timedelta(seconds=group_timeout_s)
                rank = kw["rank_offset"] + tp_rank
                store, rank, world = next(rendezvous(f"tcp://{kw['master_address']}:{kw['master_port']}", rank,
                                                     kw["world_size"], timeout=timeout))
                store.set_timeout(timeout)
                store = PrefixStore(kw["group_name"], store)
                pg, _ = _new_process_group_helper(world, rank, [], dist.Backend(kw["backend"]), store,
                                                  group_name=kw["group_name"], backend_options=None, timeout=timeout)
                _world.pg_group_ranks[pg] = {i: i for i in range(world)}
                groups[kw["group_name"]] = pg
                conn.send({"success": True, "message": f"rank {rank} of {world}"})
            elif op == "destroy":
                pg = groups.pop(kw["group_name"], None)
                if pg is not None:
                    dist.destroy_process_group(pg)
                conn.send({"success": pg is not None, "message": "destroyed" if pg is not None else
                           "The group to be destroyed does not exist."})
            elif op == "update":
                pg = groups[kw["group_name"]]
                bufs = [torch.empty(s, dtype=getattr(torch, d)) for d, s in zip(kw["dtypes"], kw["shapes"])]
                if kw.get("load_format") == "flattened_bucket":
                    flat = torch.empty(sum(b.numel() * b.element_size() for b in bufs), dtype=torch.uint8)
                    dist.broadcast(flat, src=0, group=pg)
                    off = 0
                    for b in bufs:
                        n = b.numel() * b.element_size()
                        b.view(-1).view(torch.uint8).copy_(flat[off:off + n])
                        off += n
                else:
                    for b in bufs:
                        dist.broadcast(b, src=0, group=pg)
                digest = hashlib.sha256()
                for n, b in zip(kw["names"], bufs):
                    weights[n] = b  # applied at once, bucket by bucket: not atomic, as in SGLang
                    digest.update(b.reshape(-1).view(torch.uint8).numpy().tobytes())
                conn.send({"success": True, "digest": digest.hexdigest()})
            elif op == "tensor":
                # SGLang tp_worker.update_weights_from_tensor: MultiprocessingSerializer.deserialize(
                # serialized_named_tensors[tp_rank]) (base64, SafeUnpickler), then model_runner
                # loads the list of (name, tensor) (load_format null) bucket by bucket, not atomic
                import base64
                import io
                raw = base64.b64decode(kw["entry"], validate=True) if isinstance(kw["entry"], str) else kw["entry"]
                named = _SGLangSafeUnpickler(io.BytesIO(raw)).load()
                if kw.get("load_format") is not None:
                    raise ValueError(f"the fake takes load_format null only, got {kw['load_format']!r}")
                if not isinstance(named, list) or not all(
                        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)
                        for x in named):
                    raise TypeError("serialized_named_tensors entry is not a list of (name, tensor) tuples")
                digest = hashlib.sha256()
                for n, t in named:
                    weights[n] = t.detach().clone()  # copied during the request, as SGLang's load_weights
                    digest.update(n.encode())
                    digest.update(weights[n].reshape(-1).view(torch.uint8).numpy().tobytes())
                del named
                conn.send({"success": True, "digest": digest.hexdigest()})
            elif op == "get":
                t = weights.get(kw["name"])
                conn.send({"success": t is not None,
                           "values": None if t is None else t.float().reshape(-1)[: kw["truncate_size"]].tolist()})
            else:
                conn.send({"success": False, "message": f"unknown op {op}"})
        except Exception as e:
            conn.send({"success": False, "message": f"{type(e).__name__}: {e}"})


_SGLANG_ALLOWED_PREFIXES = (
    "builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.", "weakref.",
    "torch.", "torch._tensor.", "torch.storage.", "torch.nn.parameter.", "torch.autograd.function.",
    "torch.distributed.", "torch.distributed._shard.", "torch.distributed._composable.", "torch._C._distributed_c10d.",
    "torch._C._distributed_fsdp.", "torch.distributed.optim.", "multiprocessing.resource_sharer.",
    "multiprocessing.reduction.", "pickletools.", "peft.", "transformers.", "huggingface_hub.",
    "sglang.srt.weight_sync.tensor_bucket.", "sglang.srt.model_executor.model_runner.", "sglang.srt.layers.",
    "sglang.srt.utils.", "torch_npu.",
)
"""Module prefixes SGLang 0.5.10.post1's ``SafeUnpickler`` (``srt/utils/common.py``) lets a
``/update_weights_from_tensor`` payload load; its deny list is below."""
_SGLANG_DENIED = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"), ("os", "system"),
                  ("subprocess", "Popen"), ("subprocess", "run"), ("codecs", "decode"), ("types", "CodeType"),
                  ("types", "FunctionType")}


class _SGLangSafeUnpickler(pickle.Unpickler):
    """SGLang's ``SafeUnpickler`` rule: the deny list first, then the module-prefix allow-list."""

    def find_class(self, module, name):
        if (module, name) in _SGLANG_DENIED or not any((module + ".").startswith(p) for p in _SGLANG_ALLOWED_PREFIXES):
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


class FakeSGLangServer:
    """An SGLang-shaped HTTP server on 127.0.0.1 (see the module docstring).

    Args:
        num_layers, top_k, num_experts, vocab_size: the fake model's shape.
        tp_size: TP worker processes (ranks in the update group).
        enable_return_routed_experts: the server flag; off, ``routed_experts`` is silently absent.
        token_delay_s: seconds per generated token (keeps requests running for flush/pause tests).
        routing_fault: ``None``, ``"minus_one"`` (stale padded rows written as -1) or
            ``"out_of_range"`` (an id equal to ``num_experts``).
        group_timeout_s: the workers' group timeout (SGLang keeps torch's default, 30 min).
        model_path, model_type: what ``/model_info`` and ``/server_info`` report (SGLang's server args and
            the folder's config.json ``model_type``); see :meth:`of_folder`.
        param_names: the parameters the fake model has: ``/get_weights_by_name`` answers 200 (zeros until
            received) for these and 400 ``Get parameter by name failed`` for any other, like SGLang. None:
            only the received names are known.
        skip_tokenizer_init: the server flag as ``/server_info`` reports it.

    Attributes:
        rejected: requests answered 422, by route. weight_version: the version string held.
        tensor_bodies: every ``/update_weights_from_tensor`` body that passed the schema check.
    """

    def __init__(self, *, num_layers: int, top_k: int, num_experts: int, vocab_size: int, tp_size: int = 1,
                 enable_return_routed_experts: bool = True, token_delay_s: float = 0.0,
                 routing_fault: str | None = None, group_timeout_s: float = 1800.0, port: int = 0,
                 model_path: str = "fake", model_type: str = "qwen3_moe", param_names: list[str] | None = None,
                 skip_tokenizer_init: bool = True):
        self.schema = json.loads(SCHEMA_PATH.read_text())
        self.model_path, self.model_type, self.skip_tokenizer_init = model_path, model_type, skip_tokenizer_init
        self.param_names = None if param_names is None else set(param_names)
        self.L, self.K, self.E, self.V = num_layers, top_k, num_experts, vocab_size
        self.tp_size, self.flag, self.token_delay_s = tp_size, enable_return_routed_experts, token_delay_s
        self.routing_fault = routing_fault
        self.weight_version = "default"
        self.rejected: dict[str, int] = {}
        self.tensor_bodies: list[dict] = []
        self._running = 0
        self._abort = False
        self._paused = False
        self._cond = threading.Condition()
        self._worker_lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self._pipes, self._procs = [], []
        for r in range(tp_size):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_tp_worker, args=(b, r, group_timeout_s), daemon=True)
            p.start()
            self._pipes.append(a)
            self._procs.append(p)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

            def _reply(self, status: int, obj: Any) -> None:
                text = isinstance(obj, str)
                data = obj.encode() if text else json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                u = urllib.parse.urlsplit(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                route = server.schema["routes"].get(u.path)
                if route is None:
                    self._reply(404, {"detail": "Not Found"})
                    return
                if method not in route["methods"]:
                    self._reply(405, {"detail": "Method Not Allowed"})
                    return
                if route["always_status"]:
                    self._reply(route["always_status"], {"detail": f"Endpoint '{u.path}' is deprecated."})
                    return
                body: dict = {}
                if route["body"]:
                    try:
                        body = json.loads(raw or b"{}")
                    except json.JSONDecodeError as e:
                        self._reply(422, {"detail": [{"type": "json_invalid", "msg": str(e)}]})
                        return
                    problems = server.validate(route["body"], body)
                    if problems:
                        server.rejected[u.path] = server.rejected.get(u.path, 0) + 1
                        self._reply(422, {"detail": problems})
                        return
                status, out = server.dispatch(u.path, body, urllib.parse.parse_qs(u.query))
                self._reply(status, out)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- validation ---------------------------------------------------------------------------
    def validate(self, cls: str, body: Any) -> list[dict]:
        """Problems of ``body`` against the release's dataclass ``cls`` (FastAPI's 422 detail shape)."""
        if not isinstance(body, dict):
            return [{"type": "dict_type", "loc": ["body"], "msg": "Input should be a valid dictionary"}]
        fields = {f["name"]: f for f in self.schema["classes"][cls]["fields"]}
        out = [{"type": "missing", "loc": ["body", n], "msg": "Field required"}
               for n, f in fields.items() if f["required"] and n not in body]
        out += [{"type": "extra_forbidden", "loc": ["body", n], "msg": f"Unknown field of {cls}"}
                for n in body if n not in fields]
        return out

    # -- routes -------------------------------------------------------------------------------
    def dispatch(self, path: str, body: dict, query: dict) -> tuple[int, Any]:
        if path in ("/health", "/health_generate"):
            return 200, ""
        if path == "/model_info":
            return 200, {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                         "preferred_sampling_params": None, "weight_version": self.weight_version,
                         "has_image_understanding": False, "has_audio_understanding": False,
                         "model_type": self.model_type, "architectures": ["Qwen3MoeForCausalLM"]}
        if path == "/server_info":
            return 200, {"model_path": self.model_path, "tp_size": self.tp_size, "enable_return_routed_experts": self.flag,
                         "skip_tokenizer_init": self.skip_tokenizer_init,
                         "version": self.schema["sglang_version"], "weight_version": self.weight_version}
        if path == "/flush_cache":
            with self._cond:
                if self._running:
                    return 400, "Flush cache failed: there are running or waiting requests.\n"
            return 200, ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                         "waiting requests, the operation will not be performed.)\n")
        if path == "/pause_generation":
            with self._cond:
                self._paused = True
                if body.get("mode", "abort") == "abort":
                    self._abort = True
                    while self._running:
                        self._cond.wait()
                    self._abort = False
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            with self._cond:
                self._paused = False
                self._cond.notify_all()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/init_weights_update_group":
            res = self._workers("init", body)
            ok = all(r["success"] for r in res)
            msg = "Succeeded to initialize custom process group." if ok else \
                f"Failed to initialize custom process group: {[r.get('message') for r in res]}."
            return (200 if ok else 400), {"success": ok, "message": msg}
        if path == "/destroy_weights_update_group":
            res = self._workers("destroy", {"group_name": body.get("group_name", "weight_update_group")})
            ok = all(r["success"] for r in res)
            return (200 if ok else 400), {"success": ok, "message": res[0]["message"]}
        if path == "/update_weights_from_distributed":
            res = self._workers("update", body)
            ok = all(r["success"] for r in res) and len({r.get("digest") for r in res}) == 1
            if not ok:
                return 400, {"success": False, "message": f"Failed to update parameter online: {res}. The full "
                             "weights of the ModelRunner are partially updated. Please discard the whole weights."}
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
            return 200, {"success": True, "message": "Succeeded to update parameter online."}
        if path == "/update_weights_from_tensor":
            self.tensor_bodies.append(body)
            entries = body["serialized_named_tensors"]
            if not isinstance(entries, list) or len(entries) != self.tp_size:
                # SGLang indexes serialized_named_tensors[tp_rank]: a short list fails a rank
                return 400, {"success": False, "message": f"serialized_named_tensors has {len(entries)} entries "
                             f"for tp_size {self.tp_size}: one per TP rank"}
            res = self._workers("tensor", [{"entry": e, "load_format": body.get("load_format")} for e in entries])
            ok = all(r["success"] for r in res) and len({r.get("digest") for r in res}) == 1
            if not ok:
                return 400, {"success": False, "message": f"Failed to update weights from tensor: {res}"}
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
            return 200, {"success": True, "message": "Success"}
        if path == "/get_weights_by_name":
            r = self._workers("get", {"name": body["name"], "truncate_size": body.get("truncate_size", 100)})[0]
            if not r["success"] and self.param_names is not None and body["name"] in self.param_names:
                return 200, [0.0] * int(body.get("truncate_size", 100))  # loaded at start, not received yet
            return (200, r["values"]) if r["success"] else (400, {"error": {"message": "Get parameter by name failed"}})
        if path == "/generate":
            return self._generate(body)
        return 404, {"detail": "Not Found"}

    def _workers(self, op: str, kw: dict | list[dict]) -> list[dict]:
        """Send ``op`` to every TP worker (``kw`` one dict for all, or a list: one per rank)."""
        with self._worker_lock:
            for r, p in enumerate(self._pipes):
                p.send((op, kw[r] if isinstance(kw, list) else kw))
            return [p.recv() for p in self._pipes]

    def _generate(self, body: dict) -> tuple[int, Any]:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return 400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
        sp = body.get("sampling_params") or {}
        max_new, stop = int(sp.get("max_new_tokens", 128)), set(sp.get("stop_token_ids") or [])
        start = int(body.get("routed_experts_start_len", 0))
        with self._cond:
            while self._paused:  # SGLang holds new requests while paused
                self._cond.wait()
            self._running += 1
        try:
            rng = np.random.default_rng(int.from_bytes(hashlib.sha256(np.asarray(ids).tobytes()).digest()[:8], "little"))
            out, lps, finish = [], [], None
            if start > len(ids):
                finish = {"type": "abort", "message": f"routed_experts_start_len {start} > prompt length {len(ids)}"}
            while finish is None:
                if self.token_delay_s:
                    time.sleep(self.token_delay_s)
                if self._abort:
                    finish = {"type": "abort", "message": "Abort before prefill" if not out else "Abort in running"}
                    break
                tok = int(rng.integers(0, self.V))
                out.append(tok)
                lps.append(float(-rng.exponential()))
                if tok in stop:
                    finish = {"type": "stop", "matched": tok}
                elif len(out) >= max_new:
                    finish = {"type": "length", "length": len(out)}
            meta: dict[str, Any] = {"id": hashlib.md5(repr(ids).encode()).hexdigest(), "finish_reason": finish,
                                    "prompt_tokens": len(ids), "weight_version": self.weight_version,
                                    "total_retractions": 0, "completion_tokens": len(out), "cached_tokens": 0,
                                    "reasoning_tokens": 0, "e2e_latency": 0.0}
            if body.get("return_logprob"):
                meta["input_token_logprobs"] = [[None, ids[0], None]] + [[-1.0, i, None] for i in ids[1:]]
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out)]
                meta["output_token_logprobs_length"] = len(out)
            if finish["type"] != "abort" and self.flag and body.get("return_routed_experts"):
                rows = len(ids) + len(out) - 1 - start
                arr = np.stack([rng.permutation(self.E)[: self.K] for _ in range(rows * self.L)]).astype("<i4")
                arr = arr.reshape(rows, self.L, self.K)
                if self.routing_fault == "minus_one" and rows:
                    arr[-1] = -1
                elif self.routing_fault == "out_of_range" and rows:
                    arr[0, 0, 0] = self.E
                meta["routed_experts"] = base64.b64encode(arr.tobytes()).decode()
            return 200, {"text": "", "output_ids": out, "meta_info": meta}
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def shutdown(self) -> None:
        """Stop serving and stop the TP workers."""
        self._server.shutdown()
        self._server.server_close()
        for p, proc in zip(self._pipes, self._procs):
            try:
                p.send(("stop", {}))
            except OSError:
                pass
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


def folder_shape(folder: str | Path) -> dict[str, Any]:
    """The :class:`FakeSGLangServer` keyword arguments that fake the model of a Hugging Face folder: its
    layers, top-k, experts, vocabulary, ``model_type`` and safetensors parameter names (the fixed
    2/2/4/512 shape when ``folder`` has no config.json)."""
    from t1async.config.model_folder import model_type_of, text_config
    from t1async.sampling.server_check import weight_names

    path = Path(folder) / "config.json"
    if not path.is_file():
        return {"num_layers": 2, "top_k": 2, "num_experts": 4, "vocab_size": 512}
    raw = json.loads(path.read_text())
    d = text_config(raw)
    return {"num_layers": int(d["num_hidden_layers"]), "top_k": int(d["num_experts_per_tok"]),
            "num_experts": int(d.get("num_experts", d.get("n_routed_experts", 4))), "vocab_size": int(d["vocab_size"]),
            "model_path": str(folder), "model_type": model_type_of(raw), "param_names": weight_names(Path(folder))}


def main(argv: list[str] | None = None) -> None:
    """``python -m sglang.launch_server``'s stand-in (tests/fake_sglang_pkg): the flags launch passes,
    a fake server on ``--port`` until killed."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--enable-return-routed-experts", action="store_true")
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    ap.add_argument("--weight-version", default="default")
    a = ap.parse_args(argv)
    import os

    print(f"fake sglang on {a.port}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
    print(f"--model-path {a.model_path}", flush=True)
    srv = FakeSGLangServer(**folder_shape(a.model_path), tp_size=a.tp_size, skip_tokenizer_init=a.skip_tokenizer_init,
                           enable_return_routed_experts=a.enable_return_routed_experts, port=a.port)
    srv.weight_version = a.weight_version
    while True:
        time.sleep(1)
