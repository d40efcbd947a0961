"""Token log-probs under the sampler's processed distribution (temperature, top-k, top-p).

One function scores a token for both sides: the embedded sampler (t1async/sampling/engine.py)
draws from and reports :func:`processed_logprobs`, and the learner's backends score the sampled
ids with :func:`token_logprobs`, so log mu, log pi_prox and log pi_theta are of one distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    """The tokens top-k, then top-p, keep from temperature-scaled logits (no gradient).

    Top-k (Fan et al. 2018) keeps every token at least as likely as the k-th (ties kept); top-p
    (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration") then keeps, in
    descending order of the top-k-renormalised probabilities, each token whose predecessors' mass
    is still below ``top_p``, so the most likely token always survives.

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


def _process(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
             keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float32 log-probs [..., V] of the processed distribution, bool [...] of the ``keep`` ids
    the filter itself had excluded, or None without ``keep``); see :func:`processed_logprobs`."""
    check_sampling(temperature, top_k, top_p)
    x = logits.float()
    if temperature == 0:
        if keep is not None:
            raise ValueError("temperature 0 (greedy) samples from a point mass: it has no density to score "
                             "sampled tokens under; use a temperature > 0")
        out = torch.full_like(x, float("-inf"))
        return out.scatter_(-1, x.argmax(-1, keepdim=True), 0.0), None
    x = x / temperature
    if top_k == -1 and top_p == 1.0:
        outside = None if keep is None else torch.zeros(keep.shape, dtype=torch.bool, device=keep.device)
        return F.log_softmax(x, dim=-1), outside
    kept = kept_tokens(x, top_k, top_p)
    outside = None
    if keep is not None:
        idx = keep.long().unsqueeze(-1)
        outside = ~kept.gather(-1, idx).squeeze(-1)
        kept.scatter_(-1, idx, True)
    return F.log_softmax(x.masked_fill(~kept, float("-inf")), dim=-1), outside


def processed_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, *,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs of the distribution a sampler actually draws from: ``logits / temperature``, then
    top-k, then top-p (:func:`kept_tokens`), renormalised over the kept tokens, in float32.

    The one definition the embedded engine samples from and reports, and the learner and the
    mismatch tool score under, so the behaviour log-prob log mu and the learner's log pi are of
    the same distribution.

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
    return _process(logits, temperature, top_k, top_p, keep)[0]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, top_k: int = -1,
                   top_p: float = 1.0, *, return_outside: bool = False):
    """Log-prob of each target id under the processed distribution (:func:`processed_logprobs`).

    Each target is kept in its position's kept set even where the filter would drop it: the
    sampler drew it, so it was inside the sampler's set, and the learner's set differs only
    because its logits differ (numerics on on-policy data; moved weights on off-policy data).
    Dropping it would give log pi = -inf, a zero importance weight and an undefined PPO ratio.
    Keeping it renormalises over a set one token larger than the filter's: a documented
    deviation from the sampler's processing, counted by ``return_outside``.

    Args:
        logits: float ``[B, T, V]`` (position t predicts ``targets[:, t]``).
        targets: int64 ``[B, T]``.
        temperature: > 0 (greedy sampling has no density to train on).
        top_k, top_p: as sampled with (-1 and 1.0: the plain model, ``log_softmax(logits)``).
        return_outside: also return bool ``[B, T]``, True where the target was outside the
            filter's own kept set and was kept anyway.

    Returns:
        float32 ``[B, T]`` (and the bool ``[B, T]`` when ``return_outside``).

    Raises:
        ValueError: temperature 0 or a parameter out of range.
    """
    logp, outside = _process(logits, temperature, top_k, top_p, targets)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (lp, outside) if return_outside else lp
