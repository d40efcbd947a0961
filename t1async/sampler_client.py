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


def _request(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None, url: str) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise SamplerError(f"sampler {url}{path} unreachable: {type(e).__name__}: {e}") from None
    if resp.status // 100 != 2:
        raise SamplerError(f"sampler {url}{path} answered HTTP {resp.status}: {raw[:500]!r}")
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
    """

    def __init__(self, url: str, *, num_layers: int, top_k: int, num_experts: int | None = None,
                 timeout_s: float = 300.0):
        self.url = url.rstrip("/")
        self.num_layers, self.top_k, self.num_experts, self.timeout_s = num_layers, top_k, num_experts, timeout_s
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            u = urllib.parse.urlsplit(self.url)
            c = self._local.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=self.timeout_s)
        return c

    def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any], *,
                 routed_experts_start_len: int = 0) -> SamplerResponse:
        """Sample one turn.

        Raises:
            SamplerError: transport failure, or an answer without log-probs or routed experts
                (an SGLang server started without ``--enable-return-routed-experts`` omits them
                silently; that is an error here, never a fallback).
        """
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
        ids = out.get("output_ids")
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
            raise SamplerError(f"sampler {self.url} answered bad routed experts: {e}") from None
        fr = meta.get("finish_reason") or {}
        version = meta.get("weight_version")
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise SamplerError(f"sampler {self.url} answered weight_version {version!r}, expected an integer string") from None
        return SamplerResponse(
            output_ids=[int(i) for i in ids],
            logprobs=[float(x[0]) for x in lps],
            routed_experts=experts,
            finish_reason=str(fr.get("type", "abort")) if isinstance(fr, dict) else str(fr),
            weight_version=version,
        )
