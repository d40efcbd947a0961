"""Sampler role: the embedded PyTorch engine behind an HTTP server that speaks SGLang's protocol.

Wiring only: the engine (continuous batching, t1async/sampling/engine.py), its HTTP surface
(``/generate``, pause/continue, ``/model_info``, health, flush: t1async/sampling/embedded_http.py)
and the receiving half of the weight protocol (``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/update_weights_from_tensor``,
``/destroy_weights_update_group``: t1async/weights/receiver.py, beside the learner's sending
half). Rollout actors call /generate; the learner's updates are staged while generation goes on
and swapped in between two requests, so every answer's ``weight_version`` covers all its tokens.
Stopped by :meth:`EmbeddedSampler.shutdown`.
"""

from __future__ import annotations

from typing import Any

import torch

from t1async.config import ModelConfig, SamplerConfig
from t1async.models.families import build_model
from t1async.sampling.embedded_http import NotReady, RequestError, SamplerHttp
from t1async.sampling.engine import Engine
from t1async.weights.receiver import DTYPES, WeightReceiver

__all__ = ["EmbeddedSampler", "NotReady", "RequestError"]


class EmbeddedSampler:
    """One embedded sampler: a Qwen3-MoE engine served over HTTP on ``cfg.host`` (a free port).

    ``http`` (:class:`~t1async.sampling.embedded_http.SamplerHttp`) answers the sampling routes,
    ``receiver`` (:class:`~t1async.weights.receiver.WeightReceiver`) the weight updates.

    Args:
        model_cfg: the policy architecture (weights arrive from the learner; until the first
            update the sampler answers /generate with HTTP 503).
        cfg: sampler settings (host, dtype, prefix cache, prefill chunk, batch bound).
        seed: seed of the engine's sampling RNG.
        torch_threads: intra-op threads for this process.

    Raises:
        ValueError: ``cfg.dtype`` is not one of float32, bfloat16, float16.
    """

    def __init__(self, model_cfg: ModelConfig, cfg: SamplerConfig, *, seed: int = 0, torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        if cfg.dtype not in DTYPES:
            raise ValueError(f"sampler.dtype {cfg.dtype!r} is not one of {sorted(DTYPES)}")
        self.model_cfg = model_cfg
        model = build_model(model_cfg).to(DTYPES[cfg.dtype]).eval()  # the weights arrive from the learner
        self.engine = Engine(model, seed=seed, prefix_cache=cfg.prefix_cache, prefill_chunk=cfg.prefill_chunk,
                             max_batch=cfg.max_batch)
        self.engine.weight_version = -1
        self.receiver = WeightReceiver(self.engine)
        self.engine.start()
        r = self.receiver
        self.http = SamplerHttp(self.engine, model_cfg, cfg.host, extra_routes={
            "/init_weights_update_group": r.handle_init_group,
            "/update_weights_from_distributed": r.handle_update_weights,
            "/update_weights_from_tensor": r.handle_update_weights_from_tensor,
            "/destroy_weights_update_group": r.handle_destroy_group})
        r.label = self.http.url()

    @property
    def version(self) -> int:
        """The weight version held (-1: none yet)."""
        return self.engine.weight_version

    def url(self) -> str:
        """Base URL of this sampler's HTTP server."""
        return self.http.url()

    def stats(self) -> dict[str, Any]:
        """:meth:`SamplerHttp.stats <t1async.sampling.embedded_http.SamplerHttp.stats>`: weight
        version, requests, tokens, engine counters, ``in_flight``, the process id."""
        return self.http.stats()

    def drain(self, timeout_s: float = 30.0) -> int:
        """Stop taking requests and wait up to ``timeout_s`` for the running ones; returns how many
        still ran at the end (0: drained). :meth:`SamplerHttp.drain <t1async.sampling.embedded_http.SamplerHttp.drain>`."""
        return self.http.drain(timeout_s)

    def wait_closed(self) -> None:
        """Return when :meth:`shutdown` ran (the launch's sampler pool waits on this call: it
        fails at once when the actor dies)."""
        self.http.wait_closed()

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """In-process weight swap (tools and tests without a broadcast group):
        :meth:`WeightReceiver.load_weights <t1async.weights.receiver.WeightReceiver.load_weights>`."""
        self.receiver.load_weights(state_dict, version)

    def shutdown(self) -> None:
        """Stop serving (HTTP first, then the engine thread); a second call does nothing."""
        self.http.shutdown()
