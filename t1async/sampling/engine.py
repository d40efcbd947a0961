"""Embedded sampling engine: continuous batching over per-sequence KV caches, SGLang-shaped output.

Speaks the shape of SGLang's ``/generate`` (docs/sglang.md, "The pinned protocol") so that the HTTP sampler in
front of it is indistinguishable from an SGLang server: ``output_ids`` include a matched stop
token, ``finish_reason`` is ``{"type": "stop", "matched": id}`` or ``{"type": "length",
"length": n}``, and ``routed_experts`` has one row per token fed through the model,
``[prompt_len + output_len - 1 - start_len, num_hidden_layers, num_experts_per_tok]`` int32
(the last sampled token is never fed back, so it has no row).

Continuous batching: requests are :meth:`Engine.submit`-ted from any thread; each
:meth:`Engine.step` admits waiting requests and runs ONE packed forward
(:meth:`Qwen3MoeForCausalLM.forward_packed`) over every active sequence's next tokens: the next
prefill chunk of a sequence still reading its prompt, the last sampled token of a decoding one.
Each sequence keeps its own KV cache, so a request finishing early frees its slot at once and
one arriving mid-flight joins at the next step. Exactness per sequence: a sequence's prefill is
chunked by its own prompt only (never by the load), attention runs per sequence on the shapes a
lone run uses, every row-wise op is batch invariant (t1async/models/batch_invariance.py), and each request
draws from its own generator, so its ids, log-probs, routed experts and weight version are bitwise those
of the same request run alone (tests/unit/models/test_batching.py). There is no padding token to route.

Layout: the engine stores the model's matmul weights column-major (:func:`~t1async.models.batch_invariance.
to_column_major`, at construction and after each weight swap), so that decode's few-row matmuls read the
weights without MKL's per-call transposing copy; values, names and shapes are unchanged.

Log-probs: ``output_logprobs[i]`` is the log-prob of ``output_ids[i]`` under the distribution it
was actually drawn from: ``logits / temperature``, then top-k (Fan et al. 2018), then nucleus /
top-p (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration"), renormalised over
the kept tokens, in float32 (:func:`t1async.models.logprobs.processed_logprobs`, the one function that both
draws the token here and scores it in the learner, so behaviour log mu and proximal log pi_prox
are of the same distribution). With temperature 1 and no truncation that is the plain
``log_softmax(logits)``. Temperature 0 (greedy) samples from a point mass on the argmax, so its
log-prob is reported as 0.0 (such output cannot be trained on; launch refuses it). This differs
from SGLang, whose ``output_token_logprobs`` are of the tempered softmax before top-k / top-p, not
renormalised; the learner scores each backend's own (t1async/models/logprobs.py ``SamplingSemantics``).

Sampling seeds: temperature 0 is greedy (argmax); otherwise one multinomial draw per token from
the processed distribution above, with the REQUEST's own ``torch.Generator``, seeded by
``sampling_params.sampling_seed`` (SGLang's name) or, when absent, by one draw from the engine's
generator (seeded by ``seed``) at submission. One client sending requests one after another
therefore gets the same ids from two engines of the same seed, and a request's draws never
depend on which other requests share its forwards.

Weight versions: every token of one answer comes from one weight version (SGLang's
``weight_version`` is per answer). A weight update runs inside :meth:`Engine.between_requests`:
admission pauses, in-flight requests finish (at most ``max_new_tokens`` steps), the weights are
swapped with no forward running, then admission resumes; each request reports the
:attr:`Engine.weight_version` it was admitted under. Weights written in place outside it while
requests are in flight fail those requests (never a silent mix of versions).

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
weight update has no single routing that matches both versions). With concurrent episodes keep
``prefix_cache`` >= the episodes one engine serves at once, or they evict each other.

Chunked prefill: ``prefill_chunk`` > 0 feeds the new suffix in chunks of that many tokens through
the KV cache; routing rows are concatenated in position order, so a row is never shifted or
duplicated by chunking (tested against one-shot prefill).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

from t1async.models.batch_invariance import to_column_major
from t1async.models.logprobs import check_sampling, processed_logprobs
from t1async.models.model import KVCache, PackedSegments, Qwen3MoeForCausalLM

__all__ = ["Engine", "GenerateOutput", "Request", "SamplingParams"]

_SEED_LIMIT = 2**63



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
    sampling_seed: int | None = None
    """Seed of this request's own sampling generator, in [0, 2**63) (SGLang's name). None: the
    engine draws one from its own seeded generator when the request is submitted."""

    def validate(self) -> None:
        """Raises ValueError naming the first out-of-range parameter."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_sampling(self.temperature, self.top_k, self.top_p)
        s = self.sampling_seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < _SEED_LIMIT):
            raise ValueError(f"sampling_seed must be an int in [0, 2**63) or None, got {s!r}")


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
        weight_version: :attr:`Engine.weight_version` when the request was admitted; every
            token of this answer was computed with those weights.
    """

    output_ids: list[int]
    output_logprobs: list[float]
    routed_experts: np.ndarray
    finish_reason: dict
    prompt_tokens: int
    weight_version: int = 0


def sample_with_logprob(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """Draw one id from a logits row [V] and return it with its log-prob under the distribution
    it was drawn from (:func:`t1async.models.logprobs.processed_logprobs`: temperature, top-k, top-p, float32).

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


class EngineStopped(RuntimeError):
    """A request was still queued or running when :meth:`Engine.stop` was called."""


class Request:
    """One submitted generation (:meth:`Engine.submit`); :meth:`result` waits for its answer.

    Scheduling state (engine-owned): ``cache`` (its KV, batch 1), ``routing`` (row blocks
    [n, L, K] in position order), ``out_ids``/``logprobs`` so far, ``version`` (weight version
    at admission).
    """

    def __init__(self, ids: list[int], params: SamplingParams, start_len: int, seed: int) -> None:
        self.ids, self.params, self.start_len = ids, params, start_len
        self.generator = torch.Generator().manual_seed(seed)
        self.stop = frozenset(int(t) for t in params.stop_token_ids)
        self.cache: KVCache | None = None
        self.routing: list[torch.Tensor] = []
        self.out_ids: list[int] = []
        self.logprobs: list[float] = []
        self.version = 0
        self.output: GenerateOutput | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def result(self, timeout: float | None = None) -> GenerateOutput:
        """The answer, once finished (blocks up to ``timeout`` seconds; None: no limit).

        Raises:
            TimeoutError: not finished in time. Any error the engine hit while running this
                request (for example weights changed mid-request), re-raised.
        """
        if not self.done.wait(timeout):
            raise TimeoutError(f"request not finished within {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.output is not None
        return self.output

    def _next_tokens(self, chunk: int) -> list[int]:
        """Tokens this request feeds in the next forward: its next prompt chunk (a function of
        the prompt and the cache hit alone, never of the load) or its last sampled token."""
        fed, P = self.cache.seq_len, len(self.ids)
        if fed < P:
            return self.ids[fed:min(P, fed + chunk) if chunk else P]
        return self.out_ids[-1:]


class Engine:
    """Continuous-batching sampler over a :class:`Qwen3MoeForCausalLM` (see the module docstring).

    Args:
        model: the policy; the engine stores its matmul weights column-major, in place (see Layout above: a
            forward of this model outside the engine may then differ from one before in the last bit; pass a
            copy to keep yours as it is). Replace its weights (``load_state_dict``, ``copy_``) only inside
            :meth:`between_requests` while other threads submit; the engine notices any in-place
            write to a parameter (torch's per-tensor version counters) and flushes its prefix
            cache, so a cached prefix never carries the old weights' keys, values or routing.
        seed: seed of the engine's ``torch.Generator`` that seeds each request without
            ``sampling_seed``; two engines with the same seed, weights and (serial) requests
            sample the same ids.
        prefix_cache: most sequences whose KV and routing rows are kept for reuse (LRU); 0
            disables the cache. About ``2 * layers * kv_heads * head_dim * tokens`` values each.
        prefill_chunk: feed prompts in chunks of at most this many tokens (0: one forward).
        max_batch: most sequences in one forward (>= 1); later requests wait for a free slot.

    Threads: :meth:`submit` and :meth:`between_requests` from any thread. Forwards run either
    on the engine's own thread (:meth:`start`) or, without it, inside :meth:`generate` /
    :meth:`run_until_done` on the caller's thread.

    Attributes:
        weight_version: label of the weights held (set by the sampler inside
            :meth:`between_requests`); each answer reports the one it was admitted under.
        cache_hits, cached_tokens: requests that reused a prefix, and prompt tokens not recomputed.
        forwards, forward_sequences, forward_tokens: packed forwards run, sequences and tokens
            they carried (mean batch = forward_sequences / forwards).
        busy_s: seconds the engine thread spent in :meth:`step` (forwards and sampling).
    """

    def __init__(self, model: Qwen3MoeForCausalLM, *, seed: int = 0, prefix_cache: int = 8,
                 prefill_chunk: int = 0, max_batch: int = 64) -> None:
        if prefix_cache < 0 or prefill_chunk < 0 or max_batch < 1:
            raise ValueError(f"prefix_cache ({prefix_cache}) and prefill_chunk ({prefill_chunk}) must be >= 0, "
                             f"max_batch ({max_batch}) >= 1")
        self.model = model
        to_column_major(model)
        self.generator = torch.Generator().manual_seed(int(seed))
        self.prefix_cache = int(prefix_cache)
        self.prefill_chunk = int(prefill_chunk)
        self.max_batch = int(max_batch)
        self.weight_version = 0
        self._cache: OrderedDict[int, _Cached] = OrderedDict()
        self._next_key = 0
        self._params = list(model.parameters())
        self._stamp = self._weights_stamp()
        self.cache_hits = 0
        self.cached_tokens = 0
        self.forwards = self.forward_sequences = self.forward_tokens = 0
        self.busy_s = 0.0
        # _cond guards _pending, _active and _paused (held briefly); _model_lock is held for a
        # whole step (forward + bookkeeping) or a weight swap, so the two never overlap.
        self._cond = threading.Condition(threading.Lock())
        self._model_lock = threading.RLock()
        self._pending: deque[Request] = deque()
        self._active: list[Request] = []
        self._paused = 0
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ prefix cache

    def flush_cache(self) -> None:
        """Forget every cached prefix (done automatically when the weights change)."""
        with self._model_lock:
            self._cache.clear()

    def _weights_stamp(self) -> tuple[int, ...]:
        """Identity and in-place-write counter of every parameter: changes on any weight update.
        Walks the module tree (parameters replaced, not only written, are seen); per step the
        engine checks only the write counters of the parameters it knows (:meth:`_written`)."""
        self._params = list(self.model.parameters())
        self._versions = tuple(p._version for p in self._params)
        return tuple(x for p in self._params for x in (id(p), p._version))

    def _written(self) -> bool:
        """Whether any known parameter was written in place since the last :meth:`_weights_stamp`."""
        return any(p._version != v for p, v in zip(self._params, self._versions))

    def _take_prefix(self, ids: list[int]) -> tuple[KVCache | None, torch.Tensor | None, int]:
        """Remove and return the cached entry sharing the longest prefix with ``ids`` (at least
        one token, at most ``len(ids) - 1`` so the last prompt token is always fed), truncated
        to that prefix: (kv, rows [m, L, K], m), or (None, None, 0). A cache that cannot be rolled back
        (``truncatable`` False: a hybrid model's linear-attention recurrent state) is reused only when its
        whole sequence is a prefix of ``ids``."""
        best, best_m = None, 0
        for key, c in self._cache.items():
            n = min(len(c.ids), len(ids) - 1)
            m = 0
            if n > 0 and c.ids[0] == ids[0]:
                a, b = np.asarray(c.ids[:n]), np.asarray(ids[:n])
                neq = np.flatnonzero(a != b)
                m = int(neq[0]) if neq.size else n
            if m < len(c.ids) and not c.kv.truncatable:  # recurrent state: only a whole cached sequence resumes
                m = 0
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

    # ------------------------------------------------------------------ requests

    def submit(self, input_ids: Sequence[int], params: SamplingParams, *,
               routed_experts_start_len: int = 0) -> Request:
        """Queue one request (any thread); it joins the next forward with a free slot.

        Args:
            input_ids: prompt ids (the whole episode stream so far), each in [0, vocab_size).
            params: sampling parameters.
            routed_experts_start_len: first prompt position whose routing row is returned
                (rows of an already-known prefix can be skipped); in [0, len(input_ids)].

        Returns:
            :class:`Request`; its :meth:`Request.result` is a :class:`GenerateOutput`.

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
        with self._cond:
            seed = params.sampling_seed
            if seed is None:  # drawn in submission order: serial clients reproduce
                seed = int(torch.randint(0, _SEED_LIMIT - 1, (1,), generator=self.generator))
            req = Request(ids, params, int(routed_experts_start_len), seed)
            self._pending.append(req)
            self._cond.notify_all()
        return req

    def generate(self, input_ids: Sequence[int], params: SamplingParams, *,
                 routed_experts_start_len: int = 0) -> GenerateOutput:
        """Submit one request and wait for it: prefill ``input_ids`` (reusing the longest cached
        prefix, then ``prefill_chunk``-sized forwards), then decode until a stop token is
        sampled or ``max_new_tokens`` are reached. Without the engine thread, runs the steps
        here (serving whatever else was submitted too).

        Raises:
            ValueError: as :meth:`submit`. RuntimeError: weights changed mid-request.
        """
        req = self.submit(input_ids, params, routed_experts_start_len=routed_experts_start_len)
        self.run_until_done([req])
        return req.result()

    def run_until_done(self, requests: Sequence[Request]) -> None:
        """Wait until every request in ``requests`` is finished; without the engine thread,
        step on this thread meanwhile (every queued request is served, not only these)."""
        for req in requests:
            while not req.done.is_set():
                if self._thread is not None:
                    req.done.wait()
                else:
                    self.step()

    # ------------------------------------------------------------------ scheduling

    def step(self) -> int:
        """Admit waiting requests (up to ``max_batch`` active, none while paused), run one packed
        forward over every active sequence's next tokens, sample where a sequence's prompt is
        fully fed, and finish the requests that stopped. Returns the sequences run (0: idle).

        An exception in the forward fails every request in it (their :meth:`Request.result`
        re-raises it) and the engine keeps serving.
        """
        with self._model_lock:
            with self._cond:
                while self._pending and not self._paused and len(self._active) < self.max_batch:
                    self._active.append(self._pending.popleft())
                    self._admit(self._active[-1])
                active = list(self._active)
            if not active:
                return 0
            try:
                if self._written():  # admission already flushed; anything mid-request now mixes weights
                    self._stamp = self._weights_stamp()
                    self.flush_cache()
                    raise RuntimeError("the model's weights changed while requests were in flight; update "
                                       "weights inside Engine.between_requests()")
                finished = self._forward(active)
            except Exception as e:  # fail this batch, keep serving
                for req in active:
                    req.error = e
                finished = active
            with self._cond:
                for req in finished:
                    self._active.remove(req)
                self._cond.notify_all()
            for req in finished:
                req.done.set()
            return len(active)

    def _admit(self, req: Request) -> None:
        """Give a newly active request its KV cache (a cached prefix when one matches)."""
        if not self._active[:-1]:  # nothing else in flight: full check (replaced or written parameters)
            stamp = self._weights_stamp()
            if stamp != self._stamp:  # new weights: nothing cached may carry the old ones
                self._stamp = stamp
                self._cache.clear()
        elif self._written():  # mid-flight write: step() fails the batch
            self._cache.clear()
        req.version = self.weight_version
        kv, rows, m = self._take_prefix(req.ids) if self.prefix_cache else (None, None, 0)
        if kv is None:
            req.cache = self.model.new_cache(len(req.ids) + req.params.max_new_tokens)
        else:
            req.cache = kv
            req.routing.append(rows)
            self.cache_hits += 1
            self.cached_tokens += m

    @torch.inference_mode()
    def _forward(self, active: list[Request]) -> list[Request]:
        """One packed forward over ``active``; returns the requests that finished."""
        feeds = [req._next_tokens(self.prefill_chunk) for req in active]
        device = next(self.model.parameters()).device
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=device)
        lengths = [len(f) for f in feeds]
        logits, routed = self.model.forward_packed(ids, PackedSegments([r.cache for r in active], lengths))
        self.forwards += 1
        self.forward_sequences += len(active)
        self.forward_tokens += int(ids.shape[0])
        logits = logits.cpu()
        finished, a = [], 0
        for i, req in enumerate(active):
            req.routing.append(routed[a:a + lengths[i]])
            a += lengths[i]
            if req.cache.seq_len < len(req.ids):  # still reading its prompt
                continue
            tok, lp = sample_with_logprob(logits[i], req.params, req.generator)
            req.out_ids.append(tok)
            req.logprobs.append(lp)
            if tok in req.stop:
                self._finish(req, {"type": "stop", "matched": tok})
            elif len(req.out_ids) >= req.params.max_new_tokens:
                self._finish(req, {"type": "length", "length": len(req.out_ids)})
            else:
                continue
            finished.append(req)
        return finished

    def _finish(self, req: Request, finish: dict) -> None:
        all_rows = torch.cat(req.routing, 0)
        P = len(req.ids)
        assert all_rows.shape[0] == req.cache.seq_len == P + len(req.out_ids) - 1
        self._put(req.ids + req.out_ids[:-1], req.cache, all_rows)
        req.output = GenerateOutput(
            output_ids=req.out_ids,
            output_logprobs=req.logprobs,
            routed_experts=all_rows[req.start_len:].to(torch.int32).cpu().numpy(),
            finish_reason=finish,
            prompt_tokens=P,
            weight_version=req.version,
        )
        req.cache = None
        req.routing = []

    # ------------------------------------------------------------------ serving thread, weight swaps

    def start(self) -> None:
        """Run forwards on an engine thread from now on (HTTP serving): it steps while any
        request is active or waiting, and sleeps otherwise. Stopped by :meth:`stop`."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread after its current step, then fail every request still queued
        or running with :class:`EngineStopped` (their :meth:`Request.result` raises it at once,
        so no caller waits forever on a stopped engine)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._cond:
            left = list(self._pending) + list(self._active)
            self._pending.clear()
            self._active.clear()
        for req in left:
            req.error = EngineStopped("the engine was stopped before this request finished; send it again to a "
                                      "running sampler")
            req.done.set()

    def _loop(self) -> None:
        """Engine thread: consumes submitted requests, produces finished ones; waits on
        :attr:`_cond` while idle or paused with nothing in flight; stopped by :meth:`stop`."""
        while True:
            with self._cond:
                while not self._stopping and not self._active and not (self._pending and not self._paused):
                    self._cond.wait()
                if self._stopping:
                    return
            t0 = time.perf_counter()
            self.step()
            self.busy_s += time.perf_counter() - t0

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished yet (queued or running)."""
        with self._cond:
            return len(self._pending) + len(self._active)

    def pause(self) -> None:
        """Hold admission (submitted requests queue) and return once no request runs, so no
        forward runs until :meth:`resume`. Pauses nest: each needs its own resume.

        Raises:
            RuntimeError: requests are running and the engine thread is not (nothing would
                finish them); the pause is undone.
        """
        with self._cond:
            self._paused += 1
            while self._active:
                if self._thread is None:
                    self._paused -= 1
                    raise RuntimeError("pause() with requests in flight needs the engine thread (start())")
                self._cond.wait()

    def resume(self) -> None:
        """Undo one :meth:`pause`; queued requests are admitted when none is left.

        Raises:
            RuntimeError: the engine is not paused.
        """
        with self._cond:
            if self._paused == 0:
                raise RuntimeError("resume() without a pause()")
            self._paused -= 1
            self._cond.notify_all()

    @contextmanager
    def between_requests(self) -> Iterator[None]:
        """Context in which no request is in flight and no forward runs: admission pauses, the
        requests already running finish, then the body runs (swap weights, set
        :attr:`weight_version`, flush). Waiting requests are admitted after it, under the new
        weights. Needs the engine thread (:meth:`start`) or no request in flight."""
        self.pause()
        try:
            with self._model_lock:
                try:
                    yield
                finally:
                    to_column_major(self.model)  # a parameter given new storage by the body
        finally:
            self.resume()
