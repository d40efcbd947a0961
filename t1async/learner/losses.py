"""Policy losses: a registry of one function each (today one: decoupled PPO).

A policy loss takes float ``[B, T]`` tensors ``logp`` (current policy, with gradient),
``logp_prox`` (proximal policy, the weights before this update), ``logp_behavior`` (the
sampler's), ``advantages`` and ``mask`` (1 on the tokens the policy trains), and keywords
``clip_eps``, ``is_cap`` and ``denom`` (the token count of the whole batch, so micro-batches
accumulate into one mean); it returns a :class:`t1async.learner.rl.PolicyLossOutput` (the loss
and its clip / importance-weight statistics, which metrics.jsonl reports). The update step
(:func:`t1async.learner.update.train_step`) calls ``POLICY_LOSSES[learner.policy_loss]``.

Adding a loss (CISPO, GSPO, DAPO's clip-higher): one function with this signature, registered
here and named in the ``PolicyLossName`` choice of ``learner.policy_loss`` (t1async/config/learner.py), with its test against
a reference computation in tests/unit/learner/test_rl.py.
"""

from __future__ import annotations

from typing import Callable

from t1async.learner.rl import PolicyLossOutput, policy_loss

PolicyLoss = Callable[..., PolicyLossOutput]
"""``(logp, logp_prox, logp_behavior, advantages, mask, *, clip_eps, is_cap, denom) -> PolicyLossOutput``."""

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": policy_loss,  # decoupled PPO with a truncated behaviour weight (t1async/learner/rl.py)
}
