"""Client of the Sampler protocol: SGLang's HTTP ``/generate``, spoken by SGLang and the embedded engine alike.

A rollout actor cannot tell an embedded sampler from an SGLang server: both take
``{"input_ids", "sampling_params", "return_logprob", "return_routed_experts",
"routed_experts_start_len"}`` and answer ``{"output_ids", "meta_info": {"output_token_logprobs",
"finish_reason", "weight_version", "routed_experts", ...}}``.

Source: SGLang 0.5.x HTTP API (``python/sglang/srt/entrypoints/http_server.py`` and
``GenerateReqInput``); routed experts are base64 of raw int32, row-major, shape
``[prompt_len + output_len - 1 - start_len, num_hidden_layers, num_experts_per_tok]``.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from t1async.trajectory import TrajectoryError, routed_experts_from_sglang


class SamplerError(RuntimeError):
    """The sampler answered with an error, an unexpected body, or not at all."""


def post_json(url: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float = 300.0,
              method: str = "POST") -> dict[str, Any]:
    """One JSON request on a fresh connection (control calls: weight groups, versions, health).

    Raises:
        SamplerError: connection failure, a non-2xx status, or a body that is not JSON.
    """
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        return _request(conn, method, path, body, url)
    finally:
        conn.close()


def flush_cache(url: str, *, timeout_s: float = 60.0) -> str:
    """SGLang ``POST /flush_cache``; returns its plain-text answer.

    Raises:
        SamplerError: unreachable, or HTTP 400 (requests were running, nothing was flushed).
    """
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        status, raw = _exchange(conn, "POST", "/flush_cache", None, url)
    finally:
        conn.close()
    if status // 100 != 2:
        raise SamplerError(f"sampler {url}/flush_cache answered HTTP {status}: {raw[:300].decode(errors='replace')!r}")
    return raw.decode(errors="replace")


def weight_version(url: str, *, timeout_s: float = 30.0) -> str:
    """The weight version a sampler holds, from ``GET /model_info`` (SGLang 0.5.10 answers
    ``/get_weight_version`` with 404).

    Raises:
        SamplerError: unreachable, or no ``weight_version`` in the answer.
    """
    info = post_json(url, "/model_info", method="GET", timeout_s=timeout_s)
    if "weight_version" not in info:
        raise SamplerError(f"sampler {url}/model_info has no weight_version: {sorted(info)}")
    return str(info["weight_version"])


def _exchange(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None, url: str) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise SamplerError(f"sampler {url}{path} unreachable: {type(e).__name__}: {e}") from None


def _request(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None, url: str) -> dict:
    status, raw = _exchange(conn, method, path, body, url)
    if status // 100 != 2:
        raise SamplerError(f"sampler {url}{path} answered HTTP {status}: {raw[:500]!r}")
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        raise SamplerError(f"sampler {url}{path} answered a body that is not JSON: {raw[:200]!r}") from None


@dataclass
class SamplerResponse:
    """One ``/generate`` answer, decoded.

    Attributes:
        output_ids: sampled ids (a matched stop token included as the last id).
        logprobs: float log-prob of each output id under the sampling weights.
        routed_experts: ``[prompt_len + len(output_ids) - 1 - start_len, layers, top_k]``, int32 or the
            smallest unsigned dtype holding ``num_experts`` (decoded by
            :func:`t1async.trajectory.routed_experts_from_sglang`).
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"``.
        weight_version: the weight version that produced every token of this answer.
    """

    output_ids: list[int]
    logprobs: list[float]
    routed_experts: np.ndarray
    finish_reason: str
    weight_version: int


class Sampler(Protocol):
    """What a rollout actor needs from a sampler."""

    def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any], *,
                 routed_experts_start_len: int = 0) -> SamplerResponse: ...


class HttpSampler:
    """Keep-alive HTTP client of one sampler URL (embedded engine or SGLang server).

    Args:
        url: base URL such as ``http://127.0.0.1:30000``.
        num_layers, top_k: the model's MoE shape, to decode routed experts.
        num_experts: when given, routed experts are range-checked and returned in the wire dtype
            (:func:`t1async.trajectory.experts_dtype`); otherwise as int32.
        timeout_s: per-request timeout, seconds.
        abort_retries: an answer aborted with no usable output (SGLang aborts running requests when
            the learner pauses it for a weight update, and its abort answer carries no routing) is
            sent again this many times; the retry waits while the server is paused, so it is
            sampled whole by the new weights. The prompt is unchanged, so TITO stays exact.

    Attributes:
        aborted_retries: requests re-sent after an abort.
    """

    def __init__(self, url: str, *, num_layers: int, top_k: int, num_experts: int | None = None,
                 timeout_s: float = 300.0, abort_retries: int = 3):
        self.url = url.rstrip("/")
        self.num_layers, self.top_k, self.num_experts, self.timeout_s = num_layers, top_k, num_experts, timeout_s
        self.abort_retries, self.aborted_retries = abort_retries, 0
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            u = urllib.parse.urlsplit(self.url)
            c = self._local.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=self.timeout_s)
        return c

    def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any], *,
                 routed_experts_start_len: int = 0) -> SamplerResponse:
        """Sample one turn (re-sent up to ``abort_retries`` times when aborted without usable output).

        Raises:
            SamplerError: transport failure; an answer without log-probs; routed experts missing
                (an SGLang server started without ``--enable-return-routed-experts`` omits them
                silently; that is an error here, never a fallback), of the wrong row count, or
                holding ids outside [0, num_experts) such as the -1 SGLang writes for stale
                padded rows; or per-token ``weight_versions`` spans naming more than one version
                (such tokens would be mislabelled under one version).
        """
        for attempt in range(self.abort_retries + 1):
            resp = self._generate_once(input_ids, sampling_params, routed_experts_start_len,
                                       last=attempt == self.abort_retries)
            if resp is not None:
                return resp
            self.aborted_retries += 1
        raise AssertionError("unreachable: the last attempt raises or returns")

    def _generate_once(self, input_ids: Sequence[int], sampling_params: dict[str, Any], routed_experts_start_len: int,
                       *, last: bool) -> SamplerResponse | None:
        body = {
            "input_ids": list(map(int, input_ids)),
            "sampling_params": sampling_params,
            "return_logprob": True,
            "return_routed_experts": True,
            "routed_experts_start_len": int(routed_experts_start_len),
        }
        try:
            out = _request(self._conn(), "POST", "/generate", body, self.url)
        except SamplerError:
            self._local.conn = None  # reconnect next time
            raise
        meta = out.get("meta_info") or {}
        fr = meta.get("finish_reason") or {}
        finish = str(fr.get("type", "abort")) if isinstance(fr, dict) else str(fr)
        ids = out.get("output_ids")
        if finish == "abort" and ("routed_experts" not in meta or not ids):
            if not last:
                return None  # aborted (e.g. paused for a weight update): send it again
            raise SamplerError(f"sampler {self.url} aborted the request {self.abort_retries + 1} times "
                               f"({fr.get('message') if isinstance(fr, dict) else fr!r})")
        lps = meta.get("output_token_logprobs")
        if not isinstance(ids, list) or not isinstance(lps, list) or len(lps) != len(ids):
            raise SamplerError(f"sampler {self.url} answered without output_ids/output_token_logprobs of equal length")
        if "routed_experts" not in meta:
            raise SamplerError(
                f"sampler {self.url} returned no routed_experts; start SGLang with --enable-return-routed-experts"
            )
        rows = len(input_ids) + len(ids) - 1 - routed_experts_start_len
        try:
            experts = routed_experts_from_sglang(meta["routed_experts"], rows=rows, layers=self.num_layers,
                                                 top_k=self.top_k, num_experts=self.num_experts)
        except TrajectoryError as e:
            raise SamplerError(f"sampler {self.url} answered bad routed experts ({e}); expected ids in "
                               f"[0, {self.num_experts}) for every row from a server started with "
                               "--enable-return-routed-experts (-1 marks stale padded rows)") from None
        version = meta.get("weight_version")
        spans = meta.get("weight_versions")
        if isinstance(spans, list) and spans:
            versions = {str(s.get("version")) for s in spans if isinstance(s, dict)}
            if len(versions) != 1:
                raise SamplerError(f"sampler {self.url} answered tokens of several weight versions {sorted(versions)}; "
                                   "one turn must be sampled by one version (pause mode abort)")
            version = versions.pop()
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise SamplerError(f"sampler {self.url} answered weight_version {version!r}, expected an integer string") from None
        return SamplerResponse(
            output_ids=[int(i) for i in ids],
            logprobs=[float(x[0]) for x in lps],
            routed_experts=experts,
            finish_reason=finish,
            weight_version=version,
        )
