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
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
from loguru import logger

from t1async.trajectory import TrajectoryError, routed_experts_from_sglang


class SamplerError(RuntimeError):
    """The sampler answered with an error, an unexpected body, or not at all."""


class SamplerUnavailable(SamplerError):
    """The sampler cannot take the request now: unreachable (dead, restarting, a dropped
    connection, no answer in time) or HTTP 503 (no weights yet, draining). The same request may
    be sent to another sampler (:class:`RoutedSampler`)."""


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
        raise SamplerUnavailable(f"sampler {url}{path} unreachable: {type(e).__name__}: {e}") from None


def _request(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None, url: str) -> dict:
    status, raw = _exchange(conn, method, path, body, url)
    if status == 503:
        raise SamplerUnavailable(f"sampler {url}{path} answered HTTP 503: {raw[:300]!r}")
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


class RoutedSampler:
    """A rollout actor's sampler: one of the samplers that hold weights, picked per episode and kept
    for its whole length (its prefix cache holds the episode), and another one when a request finds
    it unavailable.

    Routing is live: ``routes()`` answers the samplers that serve now (the controller's list,
    kept by the launch process's sampler pool: samplers that hold the current weights, less those
    draining, dead or restarting). It is asked at the start of each episode and after a failure.
    A request that fails with :class:`SamplerUnavailable` (the sampler died mid-request, was
    drained, restarts) is sent again, unchanged, to another sampler: it returned nothing, so the
    episode's stream is untouched (TITO stays exact) and the answer carries its own weight version.

    Args:
        urls: the samplers at start (used until ``routes`` is set, and when it answers nothing new).
        actor_id: picks this actor's sampler among them (``urls[actor_id % len(urls)]``).
        make_client: ``url -> Sampler`` (an :class:`HttpSampler`).
        routes: ``() -> list of urls`` serving now (or None: no live list); None: ``urls`` for ever.
        unavailable_for_s: how long a request keeps looking for a sampler (waiting ``retry_wait_s``
            between rounds while none serves) before it raises.

    Attributes:
        rerouted: requests sent again to another sampler after one was unavailable.
    """

    def __init__(self, urls: Sequence[str], actor_id: int, make_client: Any, *, routes: Any = None,
                 unavailable_for_s: float = 300.0, retry_wait_s: float = 0.5):
        self.urls, self.actor_id, self.make_client, self.routes = list(urls), actor_id, make_client, routes
        self.unavailable_for_s, self.retry_wait_s = unavailable_for_s, retry_wait_s
        self.rerouted = 0
        self.url: str | None = None
        self._clients: dict[str, Any] = {}

    def begin_episode(self) -> None:
        """Refresh the routing list and take this actor's sampler in it (``urls[actor_id % M]``:
        actors spread over the samplers serving now, a new one included; a new episode has no
        prefix cached anywhere, so moving costs nothing)."""
        self._refresh()
        self.url = self._pick(exclude=())

    def _refresh(self) -> None:
        got = self.routes() if self.routes is not None else None
        if got is not None:  # (None: no live list; keep the one at start)
            self.urls = list(got)

    def _pick(self, exclude: Sequence[str]) -> str | None:
        ok = [u for u in self.urls if u not in exclude]
        return ok[self.actor_id % len(ok)] if ok else None

    def client(self, url: str) -> Any:
        if url not in self._clients:
            self._clients = {u: c for u, c in self._clients.items() if u in self.urls}  # forget departed samplers
            self._clients[url] = self.make_client(url)
        return self._clients[url]

    def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any], *,
                 routed_experts_start_len: int = 0) -> SamplerResponse:
        """One turn on this episode's sampler, or on another one when it is unavailable.

        Raises:
            SamplerUnavailable: no sampler answered within ``unavailable_for_s``.
            SamplerError: any other failure (not retried: another sampler would answer alike).
        """
        deadline = time.monotonic() + self.unavailable_for_s
        tried: list[str] = []
        last: Exception | None = None
        while True:
            if self.url is None:
                self._refresh()
                self.url = self._pick(exclude=tried)
            if self.url is None:  # none serves, or every one failed this request: wait for the pool
                if time.monotonic() > deadline:
                    raise SamplerUnavailable(f"no sampler answered within {self.unavailable_for_s:.0f} s "
                                             f"(last: {last or 'none serving'})")
                time.sleep(self.retry_wait_s)
                tried = []
                continue
            try:
                return self.client(self.url).generate(input_ids, sampling_params,
                                                      routed_experts_start_len=routed_experts_start_len)
            except SamplerUnavailable as e:
                last = e
                tried.append(self.url)
                self.url = None
                self.rerouted += 1
                logger.warning("sampler unavailable, sending the request to another one: {}", e)
