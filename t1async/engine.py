"""Embedded sampling engine: one request at a time, KV-cached decoding, SGLang-shaped output.

Speaks the shape of SGLang's ``/generate`` (DESIGN.md section 3) so that the HTTP sampler in
front of it is indistinguishable from an SGLang server: ``output_ids`` include a matched stop
token, ``finish_reason`` is ``{"type": "stop", "matched": id}`` or ``{"type": "length",
"length": n}``, and ``routed_experts`` has one row per token fed through the model,
``[prompt_len + output_len - 1 - start_len, num_hidden_layers, num_experts_per_tok]`` int32
(the last sampled token is never fed back, so it has no row).

Log-probs: ``output_logprobs[i]`` is the log-prob of ``output_ids[i]`` under the distribution it
was actually drawn from: ``logits / temperature``, then top-k (Fan et al. 2018), then nucleus /
top-p (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration"), renormalised over
the kept tokens, in float32 (:func:`t1async.rl.processed_logprobs`, the one function that both
draws the token here and scores it in the learner, so behaviour log mu and proximal log pi_prox
are of the same distribution). With temperature 1 and no truncation that is the plain
``log_softmax(logits)``. Temperature 0 (greedy) samples from a point mass on the argmax, so its
log-prob is reported as 0.0 (such output cannot be trained on; launch refuses it). This differs
from SGLang, whose ``output_token_logprobs`` are of the unprocessed distribution by default.

Sampling: temperature 0 is greedy (argmax); otherwise one multinomial draw from the processed
distribution above, with the engine's own ``torch.Generator``.

Prefix cache (exact routing rows across turns): an episode's next prompt is its previous prompt
plus the previous turn's output plus new context, so the engine keeps, per recent sequence, the
KV cache *and the routing rows* of every position it fed. A request whose ids start with a
cached sequence reuses both and prefills only the new suffix. Every position of an episode is
then computed once per weight version, and the routing row the engine returns for it is the one
that actually shaped every later token's KV and log-prob (recomputing the prefix, in bf16
especially, can flip near-tie routing, so re-prefilled rows would disagree with the rows the
rollout already holds). The cache is emptied when the weights change (:meth:`Engine.flush_cache`,
as SGLang flushes its radix cache on a weight update). On a miss (another episode evicted it,
or new weights) the prefix is recomputed and its rows are the new ones; rows before
``routed_experts_start_len`` are then not returned, so a caller that already holds rows from an
older computation keeps those (documented limit: the recomputed prefix after a mid-episode
weight update has no single routing that matches both versions).

Chunked prefill: ``prefill_chunk`` > 0 feeds the new suffix in chunks of that many tokens through
the KV cache; routing rows are concatenated in position order, so a row is never shifted or
duplicated by chunking (tested against one-shot prefill).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from t1async.model import KVCache, Qwen3MoeForCausalLM
from t1async.rl import check_sampling, processed_logprobs

__all__ = ["Engine", "GenerateOutput", "SamplingParams"]


@dataclass
class SamplingParams:
    """Per-request sampling parameters (SGLang ``sampling_params`` names)."""

    max_new_tokens: int = 48
    """Most tokens to sample (>= 1); the stop token, when matched, counts as one of them."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1]; 1.0 keeps all tokens."""
    top_k: int = -1
    """Keep only the k most likely tokens (>= 1); -1 keeps all (0 is refused, as SGLang does)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Sampling one of these ends the request (it is included in ``output_ids``). The engine has
    no tokenizer: pass the end-of-turn / end-of-text ids here."""

    def validate(self) -> None:
        """Raises ValueError naming the first out-of-range parameter."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_sampling(self.temperature, self.top_k, self.top_p)


@dataclass
class GenerateOutput:
    """Result of one :meth:`Engine.generate` call (SGLang ``/generate`` fields).

    Attributes:
        output_ids: sampled ids, a matched stop token included as the last id.
        output_logprobs: float log-prob (nats) of each output id under the processed distribution
            it was sampled from (temperature, top-k, top-p; 0.0 when greedy; see module docstring).
        routed_experts: int32 [prompt_len + len(output_ids) - 1 - start_len, L, K]: expert ids of
            every token fed through the model (prompt, then each sampled token but the last),
            rows from ``routed_experts_start_len`` on.
        finish_reason: ``{"type": "stop", "matched": id}`` or ``{"type": "length", "length": n}``.
        prompt_tokens: prompt length in tokens.
    """

    output_ids: list[int]
    output_logprobs: list[float]
    routed_experts: np.ndarray
    finish_reason: dict
    prompt_tokens: int


def sample_with_logprob(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """Draw one id from a logits row [V] and return it with its log-prob under the distribution
    it was drawn from (:func:`t1async.rl.processed_logprobs`: temperature, top-k, top-p, float32).

    Temperature 0 is greedy: the argmax, with log-prob 0.0 (a point mass). The most likely token
    always survives the filters.
    """
    logp = processed_logprobs(logits, params.temperature, params.top_k, params.top_p)
    if params.temperature == 0:
        tok = int(torch.argmax(logp))
    else:
        tok = int(torch.multinomial(logp.exp(), 1, generator=generator))
    return tok, float(logp[tok])


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Draw one id from a float32 logits row [V] under ``params`` (greedy if temperature 0);
    :func:`sample_with_logprob` without the log-prob."""
    return sample_with_logprob(logits, params, generator)[0]


@dataclass
class _Cached:
    """One prefix-cache entry: the ids fed, their KV (``kv.seq_len == len(ids)``) and their
    routing rows, int64 [len(ids), L, K]."""

    ids: list[int]
    kv: KVCache
    rows: torch.Tensor


class Engine:
    """Single-sequence sampler over a :class:`Qwen3MoeForCausalLM` with a KV cache.

    Args:
        model: the policy. :attr:`model` may have its weights replaced (``load_state_dict``,
            ``copy_``) between calls (weight sync); the engine notices any in-place write to a
            parameter (torch's per-tensor version counters) and flushes its prefix cache, so a
            cached prefix never carries the old weights' keys, values or routing.
        seed: seed of the engine's private ``torch.Generator`` (CPU); two engines with the same
            seed, weights and requests sample the same ids.
        prefix_cache: most sequences whose KV and routing rows are kept for reuse (LRU); 0
            disables the cache. About ``2 * layers * kv_heads * head_dim * tokens`` values each.
        prefill_chunk: feed prompts in chunks of at most this many tokens (0: one forward).

    Not thread-safe: one :meth:`generate` at a time (the HTTP front serialises requests).

    Attributes:
        cache_hits, cached_tokens: requests that reused a prefix, and prompt tokens not recomputed.
    """

    def __init__(self, model: Qwen3MoeForCausalLM, *, seed: int = 0, prefix_cache: int = 8,
                 prefill_chunk: int = 0) -> None:
        if prefix_cache < 0 or prefill_chunk < 0:
            raise ValueError(f"prefix_cache ({prefix_cache}) and prefill_chunk ({prefill_chunk}) must be >= 0")
        self.model = model
        self.generator = torch.Generator().manual_seed(int(seed))
        self.prefix_cache = int(prefix_cache)
        self.prefill_chunk = int(prefill_chunk)
        self._cache: OrderedDict[int, _Cached] = OrderedDict()
        self._next_key = 0
        self._stamp = self._weights_stamp()
        self.cache_hits = 0
        self.cached_tokens = 0

    def flush_cache(self) -> None:
        """Forget every cached prefix (done automatically when the weights change)."""
        self._cache.clear()

    def _weights_stamp(self) -> tuple[int, ...]:
        """Identity and in-place-write counter of every parameter: changes on any weight update."""
        return tuple(x for p in self.model.parameters() for x in (id(p), p._version))

    def _take_prefix(self, ids: list[int]) -> tuple[KVCache | None, torch.Tensor | None, int]:
        """Remove and return the cached entry sharing the longest prefix with ``ids`` (at least
        one token, at most ``len(ids) - 1`` so the last prompt token is always fed), truncated
        to that prefix: (kv, rows [m, L, K], m), or (None, None, 0)."""
        best, best_m = None, 0
        for key, c in self._cache.items():
            n = min(len(c.ids), len(ids) - 1)
            m = 0
            if n > 0 and c.ids[0] == ids[0]:
                a, b = np.asarray(c.ids[:n]), np.asarray(ids[:n])
                neq = np.flatnonzero(a != b)
                m = int(neq[0]) if neq.size else n
            if m > best_m:
                best, best_m = key, m
        if best is None:
            return None, None, 0
        c = self._cache.pop(best)
        c.kv.seq_len = best_m  # later positions are overwritten by the next write
        return c.kv, c.rows[:best_m], best_m

    def _put(self, ids: list[int], kv: KVCache, rows: torch.Tensor) -> None:
        if self.prefix_cache == 0:
            return
        self._cache[self._next_key] = _Cached(ids, kv, rows)
        self._next_key += 1
        while len(self._cache) > self.prefix_cache:
            self._cache.popitem(last=False)

    @torch.inference_mode()
    def generate(self, input_ids: Sequence[int], params: SamplingParams, *,
                 routed_experts_start_len: int = 0) -> GenerateOutput:
        """Prefill ``input_ids`` (reusing the longest cached prefix, then ``prefill_chunk``-sized
        forwards, see the module docstring), then decode token by token until a stop token is
        sampled or ``max_new_tokens`` are reached.

        Args:
            input_ids: prompt ids (the whole episode stream so far), each in [0, vocab_size).
            params: sampling parameters.
            routed_experts_start_len: first prompt position whose routing row is returned
                (rows of an already-known prefix can be skipped); in [0, len(input_ids)].

        Returns:
            :class:`GenerateOutput`.

        Raises:
            ValueError: empty prompt, ids out of range, invalid ``params``, a start length out
                of range, or a prompt longer than ``max_position_embeddings - max_new_tokens``.
        """
        params.validate()
        cfg = self.model.cfg
        ids = [int(i) for i in input_ids]
        P = len(ids)
        if P == 0:
            raise ValueError("input_ids is empty; the prompt needs at least one token")
        if min(ids) < 0 or max(ids) >= cfg.vocab_size:
            raise ValueError(f"input_ids must be in [0, vocab_size={cfg.vocab_size}), got range "
                             f"[{min(ids)}, {max(ids)}]")
        limit = cfg.max_position_embeddings - params.max_new_tokens
        if P > limit:
            raise ValueError(f"prompt of {P} tokens is too long: at most max_position_embeddings "
                             f"({cfg.max_position_embeddings}) - max_new_tokens ({params.max_new_tokens})"
                             f" = {limit} tokens")
        if not 0 <= routed_experts_start_len <= P:
            raise ValueError(f"routed_experts_start_len must be in [0, prompt length {P}], got "
                             f"{routed_experts_start_len}")
        stop = set(int(s) for s in params.stop_token_ids)
        device = next(self.model.parameters()).device
        stamp = self._weights_stamp()
        if stamp != self._stamp:
            self.flush_cache()
            self._stamp = stamp
        cache, prefix_rows, m = self._take_prefix(ids) if self.prefix_cache else (None, None, 0)
        routing: list[torch.Tensor] = []  # [T, L, K] per forward, in position order
        if cache is None:
            cache = KVCache(capacity=P + params.max_new_tokens)
        else:
            routing.append(prefix_rows)
            self.cache_hits += 1
            self.cached_tokens += m
        chunk = self.prefill_chunk or P
        for a in range(m, P, chunk):
            b = min(P, a + chunk)
            out = self.model(torch.tensor([ids[a:b]], device=device), kv_cache=cache, return_routing=True,
                             logits_to_keep=1)
            routing.append(out.routed_experts[0])
        out_ids: list[int] = []
        logprobs: list[float] = []
        finish: dict = {}
        step = torch.empty(1, 1, dtype=torch.long, device=device)
        while True:
            logits = out.logits[0, -1].float().cpu()
            tok, lp = sample_with_logprob(logits, params, self.generator)
            logprobs.append(lp)
            out_ids.append(tok)
            if tok in stop:
                finish = {"type": "stop", "matched": tok}
                break
            if len(out_ids) >= params.max_new_tokens:
                finish = {"type": "length", "length": len(out_ids)}
                break
            step.fill_(tok)
            out = self.model(step, kv_cache=cache, return_routing=True)
            routing.append(out.routed_experts[0])

        all_rows = torch.cat(routing, 0)
        assert all_rows.shape[0] == cache.seq_len == P + len(out_ids) - 1
        self._put(ids + out_ids[:-1], cache, all_rows)
        rows = all_rows[routed_experts_start_len:]
        return GenerateOutput(
            output_ids=out_ids,
            output_logprobs=logprobs,
            routed_experts=rows.to(torch.int32).cpu().numpy(),
            finish_reason=finish,
            prompt_tokens=P,
        )
