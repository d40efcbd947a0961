"""Token log-probs under the distribution each sampler backend reports (temperature, top-k, top-p).

One module scores a token for both sides. The embedded sampler (t1async/sampling/engine.py) draws
from and reports :func:`processed_logprobs`: the tempered distribution renormalised over the
tokens top-k and top-p keep. An SGLang server reports something else (:data:`SGLANG`): the
tempered softmax over the whole vocabulary, whatever it kept. The learner's backends score the
sampled ids with :func:`token_logprobs` under the :class:`SamplingSemantics` of the run's
``sampler.backend`` (:func:`sampling_semantics`), so log mu, log pi_prox and log pi_theta are of
one distribution and the importance weight of identical weights is exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["EMBEDDED", "SAMPLING_SEMANTICS", "SGLANG", "SamplingSemantics", "check_sampling", "joint_kept_tokens",
           "kept_tokens", "processed_logprobs", "sampling_semantics", "token_logprobs"]


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Refuse sampling parameters outside SGLang's ranges (the same ranges config, engine and learner use).

    Raises:
        ValueError: naming the first bad parameter: temperature < 0, top_k neither -1 (all) nor
            >= 1 (SGLang refuses 0 too), or top_p outside (0, 1].
    """
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if not (top_k == -1 or top_k >= 1):
        raise ValueError(f"top_k must be -1 (keep all) or >= 1, got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def kept_tokens(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens top-k, then top-p, keep from temperature-scaled logits (the embedded engine's
    filter; no gradient).

    Top-k (Fan et al. 2018) keeps every token at least as likely as the k-th (ties kept); top-p
    (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration") then keeps, in
    descending order of the top-k-renormalised probabilities, each token whose predecessors' mass
    is still below ``top_p`` (a token whose predecessors hold exactly ``top_p`` is dropped), so
    the most likely token always survives.

    Args:
        scaled: float ``[..., V]`` logits already divided by the temperature.
        top_k: -1 keeps all; k >= V keeps all.
        top_p: in (0, 1]; 1.0 keeps all.

    Returns:
        bool ``[..., V]``, True where the token is kept.
    """
    with torch.no_grad():
        x = scaled.detach()
        keep = torch.ones_like(x, dtype=torch.bool)
        if 0 < top_k < x.shape[-1]:
            kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
            keep = x >= kth
            x = x.masked_fill(~keep, float("-inf"))
        if top_p < 1.0:
            sorted_x, order = torch.sort(x, dim=-1, descending=True)
            p = torch.softmax(sorted_x, dim=-1)
            drop = (torch.cumsum(p, dim=-1) - p) >= top_p  # the mass before it already reaches top_p
            drop[..., 0] = False
            keep = keep & ~torch.zeros_like(drop).scatter(-1, order, drop)
    return keep


def joint_kept_tokens(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens SGLang's joint top-k / top-p filter keeps from temperature-scaled logits (no gradient).

    Both filters read the same ranking of the full tempered softmax ``p`` (descending; tied
    probabilities in the order the sort leaves them): a token is kept when its rank is below
    ``top_k`` AND the mass of the tokens ranked before it is at most ``top_p`` (cut only where
    it exceeds ``top_p``, so a token whose predecessors hold exactly ``top_p`` is kept). Unlike
    :func:`kept_tokens`, top-k keeps exactly k tokens (no tie extension) and top-p measures mass
    in the whole distribution, not the top-k-renormalised one.

    Source: SGLang 0.5.10.post1 ``python/sglang/srt/layers/sampler.py``, its torch sampler
    (``--sampling-backend pytorch``; the default flashinfer kernel is called with
    ``filter_apply_order="joint"``, the same rule), read and restated here, not copied.

    Args:
        scaled: float ``[..., V]`` logits already divided by the temperature.
        top_k: -1 keeps all; k >= V keeps all.
        top_p: in (0, 1]; 1.0 keeps all.

    Returns:
        bool ``[..., V]``, True where the token is kept.
    """
    with torch.no_grad():
        x = scaled.detach()
        p_sorted, order = torch.sort(torch.softmax(x.float(), dim=-1), dim=-1, descending=True)
        keep_sorted = torch.ones_like(p_sorted, dtype=torch.bool)
        if 0 < top_k < x.shape[-1]:
            keep_sorted[..., top_k:] = False
        if top_p < 1.0:
            keep_sorted &= ~((torch.cumsum(p_sorted, dim=-1) - p_sorted) > top_p)
        return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@dataclass(frozen=True)
class SamplingSemantics:
    """Which distribution a sampler backend's reported log-probs are of, so that the learner
    scores the same one (:func:`token_logprobs`).

    Both semantics start from ``logits / temperature`` (float32). They differ in the set the
    sampler draws from and in whether the reported log-prob is renormalised over it:

    ==========  =============================================  =====================================
    backend     kept set (the tokens the sampler may draw)     reported log-prob of the drawn token
    ==========  =============================================  =====================================
    embedded    :func:`kept_tokens` (top-k then top-p, cut     log of the kept-set-renormalised
                where the mass before reaches top_p)           probability (the draw's true density)
    sglang      :func:`joint_kept_tokens` (top-k and top-p     ``log_softmax(logits / T)`` over the
                jointly, cut where it exceeds top_p)           whole vocabulary, not renormalised
    ==========  =============================================  =====================================

    Without truncation (top_k -1, top_p 1.0) the two are the same distribution. With truncation
    under ``sglang`` the importance weight pi/mu is a ratio of tempered softmaxes: exactly 1 on
    identical weights; between two weight versions it differs from the ratio of the truncated
    distributions the tokens were drawn from by ``Z_mu / Z_pi`` (the kept mass under each), which
    SGLang does not report, so no learner can recover it.

    Attributes:
        name: the ``sampler.backend`` it belongs to.
        renormalised: True: log-probs renormalised over the kept set; False: of the full
            tempered softmax (the kept set then only decides the ``outside`` count).
        joint: True: SGLang's joint filter (:func:`joint_kept_tokens`); False: the embedded
            engine's sequential one (:func:`kept_tokens`).
    """

    name: str
    renormalised: bool
    joint: bool

    def kept(self, scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
        """bool ``[..., V]``: the tokens this backend's sampler may draw from ``scaled`` (logits / T)."""
        return (joint_kept_tokens if self.joint else kept_tokens)(scaled, top_k, top_p)

    def process(self, logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(float32 ``[..., V]`` reported log-probs, bool ``[...]`` where a ``keep`` id was outside
        the filter's own kept set, or None without ``keep``).

        ``keep``: optional int ``[...]`` ids kept in the set whatever the filter says (see
        :func:`token_logprobs`); with ``renormalised`` False it changes no log-prob.
        Temperature 0 (greedy): the embedded engine reports a point mass on the argmax (log-prob
        0.0 there, -inf elsewhere); SGLang reports ``log_softmax(logits)`` (it samples greedily
        at temperature 1 and top-k 1).

        Raises:
            ValueError: a parameter out of range (:func:`check_sampling`), or ``keep`` with temperature 0.
        """
        check_sampling(temperature, top_k, top_p)
        x = logits.float()
        if temperature == 0:
            if keep is not None:
                raise ValueError("temperature 0 (greedy) samples from a point mass: it has no density to score "
                                 "sampled tokens under; use a temperature > 0")
            if not self.renormalised:
                return F.log_softmax(x, dim=-1), None
            out = torch.full_like(x, float("-inf"))
            return out.scatter_(-1, x.argmax(-1, keepdim=True), 0.0), None
        x = x / temperature
        if top_k == -1 and top_p == 1.0:
            outside = None if keep is None else torch.zeros(keep.shape, dtype=torch.bool, device=keep.device)
            return F.log_softmax(x, dim=-1), outside
        if not self.renormalised and keep is None:
            return F.log_softmax(x, dim=-1), None
        kept = self.kept(x, top_k, top_p)
        outside = None
        if keep is not None:
            idx = keep.long().unsqueeze(-1)
            outside = ~kept.gather(-1, idx).squeeze(-1)
            kept.scatter_(-1, idx, True)
        if not self.renormalised:
            return F.log_softmax(x, dim=-1), outside
        return F.log_softmax(x.masked_fill(~kept, float("-inf")), dim=-1), outside


EMBEDDED = SamplingSemantics("embedded", renormalised=True, joint=False)
"""The embedded engine (t1async/sampling/engine.py): draws from and reports the renormalised kept set."""

SGLANG = SamplingSemantics("sglang", renormalised=False, joint=True)
"""SGLang 0.5.10.post1 (``srt/layers/sampler.py``, default server): the drawn token's
``log(softmax(logits / T))``, computed before top-k / top-p and never renormalised over the
joint kept set. Holds with the flashinfer, pytorch and ascend sampling backends and with
``--rl-on-policy-target`` (the same formula, in bfloat16); NOT with the server environment
variable ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set (it then reports ``log_softmax(logits)``,
untempered: launch refuses it at a temperature other than 1)."""

SAMPLING_SEMANTICS = {"embedded": EMBEDDED, "sglang": SGLANG}
"""``sampler.backend`` -> the semantics of the log-probs its samplers report."""


def sampling_semantics(backend: str) -> SamplingSemantics:
    """The :class:`SamplingSemantics` of ``sampler.backend`` ``backend``.

    Raises:
        ValueError: ``backend`` is not a key of :data:`SAMPLING_SEMANTICS`.
    """
    if backend not in SAMPLING_SEMANTICS:
        raise ValueError(f"sampler.backend={backend!r} has no log-prob semantics; use one of {sorted(SAMPLING_SEMANTICS)}")
    return SAMPLING_SEMANTICS[backend]


def processed_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, *,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs of the distribution the embedded sampler actually draws from: ``logits /
    temperature``, then top-k, then top-p (:func:`kept_tokens`), renormalised over the kept
    tokens, in float32 (:data:`EMBEDDED`).

    The one definition the embedded engine samples from and reports, and the learner and the
    mismatch tool score under with that backend, so the behaviour log-prob log mu and the
    learner's log pi are of the same distribution.

    Args:
        logits: float ``[..., V]`` (any float dtype; computed in float32). Gradients flow through
            the kept logits.
        temperature: >= 0. 0 is greedy: a point mass on ``argmax`` (log-prob 0.0 there, -inf
            elsewhere, no gradient).
        top_k: -1 (keep all) or >= 1.
        top_p: in (0, 1].
        keep: optional int ``[...]`` ids (the shape of ``logits`` without V) kept whatever the
            filter says: a learner scoring sampled tokens keeps each sampled id even where its own,
            numerically slightly different, logits put it just outside the nucleus.

    Returns:
        float32 ``[..., V]``, -inf outside the kept set; ``exp`` sums to 1 over V.

    Raises:
        ValueError: a parameter out of range (:func:`check_sampling`), or ``keep`` with temperature 0.
    """
    return EMBEDDED.process(logits, temperature, top_k, top_p, keep)[0]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, top_k: int = -1,
                   top_p: float = 1.0, *, semantics: SamplingSemantics = EMBEDDED, return_outside: bool = False):
    """Log-prob of each target id as the sampler backend of ``semantics`` reports it
    (:class:`SamplingSemantics`: renormalised over the kept set for the embedded engine, the
    full tempered softmax for SGLang).

    Each target is kept in its position's kept set even where the filter would drop it: the
    sampler drew it, so it was inside the sampler's set, and the learner's set differs only
    because its logits differ (numerics on on-policy data; moved weights on off-policy data).
    Dropping it would give log pi = -inf, a zero importance weight and an undefined PPO ratio.
    Under renormalised semantics keeping it renormalises over a set one token larger than the
    filter's: a documented deviation from the sampler's processing, counted by
    ``return_outside`` (under SGLang's it changes no log-prob and is only counted).

    Args:
        logits: float ``[B, T, V]`` (position t predicts ``targets[:, t]``).
        targets: int64 ``[B, T]``.
        temperature: > 0 (greedy sampling has no density to train on).
        top_k, top_p: as sampled with (-1 and 1.0: the plain model, ``log_softmax(logits)``).
        semantics: the run's sampler backend's (:func:`sampling_semantics`); default the embedded engine's.
        return_outside: also return bool ``[B, T]``, True where the target was outside the
            filter's own kept set and was kept anyway.

    Returns:
        float32 ``[B, T]`` (and the bool ``[B, T]`` when ``return_outside``).

    Raises:
        ValueError: temperature 0 or a parameter out of range.
    """
    logp, outside = semantics.process(logits, temperature, top_k, top_p, targets)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (lp, outside) if return_outside else lp
