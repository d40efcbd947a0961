"""The learner's intake check: a decoded trajectory against the run's own facts (pure; no I/O).

:func:`t1async.trajectory.decode` checks what a frame can say about itself (shapes, dtypes,
spans, masks, expert ids within the frame's own ``num_experts``). What only the run knows is
checked here, at receipt and again when the receive log is replayed on resume, so that no
trajectory a step cannot train ever reaches one (one such trajectory used to end the run: an id
past the embedding raised ``IndexError`` in the step, and every resume replayed it again):

- ``length``: at most ``max_tokens`` positions: the model's context (``model.max_position_embeddings``)
  and the run's own bound on an episode (``env.max_context_tokens``), whichever is smaller
  (:func:`context_limit`). A longer stream is valid-looking but no step should hold it: one of
  16,384 tokens against a context of 8,192 stalled the learner 8.5 minutes, and the resume
  replayed it (issue 42);
- ``token_ids``: every id < ``model.vocab_size`` (the rows of the embedding and the LM head);
- ``routed_experts``: every id < ``model.num_experts`` and the ``top_k`` ids of a row distinct
  (a router's top-k never repeats an expert; Megatron's replay refuses a repeated one);
- ``versions``: no sampled token claims a weight version later than the last one published;
- ``logprobs``: finite at every position (the convention is 0 off the loss mask; a NaN there
  still turns a masked sum into NaN);
- ``tests``/``passed``/``total``/``reward``: ``total`` is the number of per-test results,
  ``passed`` the number that passed, the reward lies in ``[0, total]`` and equals ``passed``
  (``learner.reward: dense``, the reward is tests passed: t1async/envs/verifier.py), and ``resolved``
  holds exactly when every test passed, at least one ran and the verifier reported no error
  (``learner.reward: binary`` trains ``resolved`` as 1 or 0, so it must agree with the tests).

Each failure raises :class:`t1async.trajectory.TrajectoryError` whose ``field`` is the reason it is
counted under (``rejected_by`` in the learner's status, metrics.jsonl and summary.json).
Cost: one pass over the token ids and a few over the routed experts (about 25 ms for 32k tokens x
48 layers x top-8 on a busy 2-core machine; the rest is negligible).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from t1async.trajectory import Trajectory, TrajectoryError

REWARD_KINDS = ("dense", "binary")


@dataclass(frozen=True)
class RunFacts:
    """What the learner's run fixes about every trajectory it may train.

    Attributes:
        vocab_size: ``model.vocab_size``: token ids must be below it.
        num_experts: ``model.num_experts``: routed expert ids must be below it.
        num_layers: ``model.num_hidden_layers`` (MoE layers of the routed-experts rows).
        top_k: ``model.num_experts_per_tok`` (experts per row, distinct).
        reward: ``learner.reward``, ``dense`` or ``binary``.
        max_tokens: most token positions a trajectory may have (:func:`context_limit`); 0: not checked.
    """

    vocab_size: int
    num_experts: int
    num_layers: int
    top_k: int
    reward: str = "dense"
    max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.reward not in REWARD_KINDS:
            raise ValueError(f"learner.reward {self.reward!r} is not one of {REWARD_KINDS}")
        for name in ("vocab_size", "num_experts", "num_layers", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunFacts.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens < 0:
            raise ValueError(f"RunFacts.max_tokens must be >= 0 (0: unchecked), got {self.max_tokens}")


def context_limit(max_position_embeddings: int, max_context_tokens: int = 0) -> int:
    """Most token positions the learner trains: ``model.max_position_embeddings``, or the run's
    ``env.max_context_tokens`` where that is set (> 0) and smaller (the rollout ends an episode
    before its stream would pass it: t1async/rollout/episode.py).

    Args:
        max_position_embeddings: the model's context, tokens (>= 1).
        max_context_tokens: ``env.max_context_tokens``; 0: the model's context.
    """
    return min(max_position_embeddings, max_context_tokens) if max_context_tokens > 0 else max_position_embeddings


def check_trajectory(traj: Trajectory, facts: RunFacts, *, max_version: int | None = None) -> None:
    """Check a decoded trajectory (already through :func:`t1async.trajectory.validate`) against ``facts``.

    Args:
        traj: the trajectory; arrays of the wire dtypes (token_ids uint32 ``[T]``, logprobs
            float32 ``[T]``, routed_experts unsigned ``[T-1, L, K]``).
        facts: the run's vocabulary, expert count, routing shape and reward kind.
        max_version: the last weight version published; None: not checked here.

    Raises:
        TrajectoryError: naming the first field that breaks a rule of the module docstring.
    """
    if facts.max_tokens and traj.token_ids.size > facts.max_tokens:
        raise TrajectoryError("length", f"{traj.token_ids.size} tokens, more than the {facts.max_tokens} the run "
                                        "trains (model.max_position_embeddings, or env.max_context_tokens if smaller)")
    _check_tokens(traj, facts.vocab_size)
    if not np.isfinite(traj.logprobs).all():
        bad = int(np.flatnonzero(~np.isfinite(traj.logprobs))[0])
        raise TrajectoryError("logprobs", f"{traj.logprobs[bad]} at position {bad} is not finite")
    if max_version is not None:
        v = traj.versions[traj.loss_mask.view(bool)]
        if v.size and int(v.max()) > max_version:
            raise TrajectoryError("versions", f"version {int(v.max())} was never published (the last is {max_version})")
    _check_routing(traj.routed_experts, facts)
    _check_reward(traj, facts.reward)


def _check_tokens(traj: Trajectory, vocab_size: int) -> None:
    ids = traj.token_ids
    if ids.size and int(ids.max()) >= vocab_size:
        pos = int(np.flatnonzero(ids >= vocab_size)[0])
        raise TrajectoryError("token_ids", f"id {int(ids[pos])} at position {pos} is outside the vocabulary of "
                                           f"{vocab_size} (model.vocab_size)")


def _check_routing(re: np.ndarray, facts: RunFacts) -> None:
    if re.ndim != 3 or re.shape[1:] != (facts.num_layers, facts.top_k):
        raise TrajectoryError("routed_experts", f"rows of shape {re.shape[1:]}, the model routes "
                                                f"({facts.num_layers} layers, top-{facts.top_k})")
    if not re.size:
        return
    if int(re.max()) >= facts.num_experts:
        raise TrajectoryError("routed_experts", f"expert id {int(re.max())} >= model.num_experts {facts.num_experts}")
    K = facts.top_k
    if K < 2:
        return
    cols = np.ascontiguousarray(re.reshape(-1, K).T)  # [K, rows]: the pairwise compares run on contiguous memory
    same = np.empty(cols.shape[1], dtype=bool)
    for i in range(K):
        for j in range(i + 1, K):
            np.equal(cols[i], cols[j], out=same)
            if same.any():
                row = int(np.flatnonzero(same)[0])
                pos, layer = divmod(row, facts.num_layers)
                raise TrajectoryError("routed_experts", f"expert {int(cols[i, row])} appears twice in the top-{K} of "
                                                        f"position {pos}, layer {layer}; a router's top-k is distinct")


def _check_reward(traj: Trajectory, kind: str) -> None:
    n_tests, n_passed = len(traj.tests), sum(bool(p) for _, p in traj.tests)
    if traj.total != n_tests:
        raise TrajectoryError("total", f"{traj.total} tests, but {n_tests} per-test results")
    if traj.passed != n_passed:
        raise TrajectoryError("passed", f"{traj.passed} passed, but {n_passed} of the per-test results passed")
    if not 0.0 <= traj.reward <= traj.total:
        raise TrajectoryError("reward", f"{traj.reward!r} is outside [0, {traj.total}] (tests total)")
    if traj.reward != traj.passed:
        raise TrajectoryError("reward", f"{traj.reward!r} differs from the {traj.passed} tests passed "
                                        "(the dense reward is the number of tests passed)")
    resolved = traj.verifier_error is None and traj.total > 0 and traj.passed == traj.total
    if traj.resolved != resolved:
        raise TrajectoryError("resolved", f"{traj.resolved}, but {traj.passed} of {traj.total} tests passed"
                                          + (f" and the verifier failed ({traj.verifier_error[:200]})"
                                             if traj.verifier_error else "")
                                          + (" (learner.reward: binary trains resolved as the reward)"
                                             if kind == "binary" else ""))
