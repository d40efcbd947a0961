"""Episodes and turns that did not end normally: what the learner trains of them (``learner.abnormal``).

The rollout actor records each abnormal end on the trajectory (t1async/rollout/episode.py): per turn in
``turn_status`` (codes in :data:`t1async.trajectory.TURN_STATUS`), per episode in
``finish_reason`` and ``verifier_error``. This module maps each to a kind of
:class:`~t1async.config.AbnormalConfig` and applies its action:

    kind             recorded as                                     actions
    length_cut       turn_status 1 (run anyway) or 5 (not run)       train, mask_turn, drop
    aborted          turn_status 2                                   train, mask_turn, drop
    command_timeout  turn_status 3                                   train, mask_turn, drop
    sandbox_refused  turn_status 4                                   train, mask_turn, drop
    tool_call_error  turn_status 6-11 (a malformed tool call)        train, mask_turn, drop
    context_full     finish_reason "context_full"                    train, drop
    episode_timeout  finish_reason "timeout"                         train, drop
    verifier_error   verifier_error set                              always drop

A verifier that timed out is not a ``verifier_error``: the harnesses score it a failure, so the
episode arrives with its reward (0, the failed test ``verifier_timeout``) and is trained like
any other (t1async/envs/verifier.py). ``verifier_error`` is left for what is not the agent's
doing (no test summary, the verifier environment's missing module, a bad reward file);
infrastructure failures (a sandbox that died, an image that could not be built) never become a
trajectory at all.

``mask_turn`` removes a turn's sampled tokens from the policy loss only
(:func:`policy_mask`); advantages are still computed by GAE over every sampled token, and the
critic still trains on all of them (see ``TrainingLoop._train_step``, t1async/learner/loop.py). Pure numpy, no backend.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import numpy as np

from t1async.config import AbnormalConfig
from t1async.trajectory import (
    TOOL_CALL_ERRORS,
    TURN_ABORTED,
    TURN_COMMAND_TIMEOUT,
    TURN_CUT_NOT_RUN,
    TURN_LENGTH_CUT,
    TURN_OK,
    TURN_SANDBOX_REFUSED,
    TURN_STATUS,
    Trajectory,
)

TURN_KINDS = {TURN_LENGTH_CUT: "length_cut", TURN_CUT_NOT_RUN: "length_cut", TURN_ABORTED: "aborted",
              TURN_COMMAND_TIMEOUT: "command_timeout", TURN_SANDBOX_REFUSED: "sandbox_refused",
              **dict.fromkeys(TOOL_CALL_ERRORS, "tool_call_error")}
"""``turn_status`` code -> the :class:`AbnormalConfig` field that decides what is done with the turn."""
EPISODE_KINDS = {"context_full": "context_full", "timeout": "episode_timeout"}
"""``finish_reason`` -> the :class:`AbnormalConfig` field that decides what is done with the episode."""
ALL_MASKED = "all_turns_masked"
"""Drop reason of a trajectory whose every loss token was masked by ``mask_turn``."""
DROP_REASONS = ("stale", "verifier_error", *dict.fromkeys(TURN_KINDS.values()), *EPISODE_KINDS.values(), ALL_MASKED)
"""Every reason the learner drops a trajectory for (the keys of metrics.jsonl ``dropped``)."""


def masked_turns(traj: Trajectory, cfg: AbnormalConfig) -> np.ndarray:
    """[turns] bool: the turns whose kind is set to ``mask_turn``."""
    codes = [code for code, kind in TURN_KINDS.items() if getattr(cfg, kind) == "mask_turn"]
    return np.isin(traj.turn_status, codes)


def policy_mask(traj: Trajectory, cfg: AbnormalConfig) -> np.ndarray:
    """[T] uint8: ``traj.loss_mask`` with the sampled span of every masked turn set to 0 (a new array).

    Only the spans of :func:`masked_turns` change; every other position is the loss mask as sent.
    """
    mask = np.array(traj.loss_mask, dtype=np.uint8, copy=True)
    for s, e in traj.turn_offsets[masked_turns(traj, cfg)]:
        mask[s:e] = 0
    return mask


def drop_reason(traj: Trajectory, cfg: AbnormalConfig) -> str | None:
    """Why the learner must drop ``traj`` (a key of :data:`DROP_REASONS`), or None to train it.

    First match wins: a verifier error, an episode end set to ``drop``, the lowest turn code set
    to ``drop``, then every loss token masked.
    """
    if traj.verifier_error is not None:
        return "verifier_error"
    kind = EPISODE_KINDS.get(traj.finish_reason)
    if kind is not None and getattr(cfg, kind) == "drop":
        return kind
    for code in np.unique(traj.turn_status).tolist():
        kind = TURN_KINDS.get(code)
        if kind is not None and getattr(cfg, kind) == "drop":
            return kind
    if masked_turns(traj, cfg).any() and not policy_mask(traj, cfg).any():
        return ALL_MASKED
    return None


def drop_detail(traj: Trajectory, reason: str) -> str:
    """One line saying what made :func:`drop_reason` answer ``reason`` (for logs and the controller)."""
    if reason == "verifier_error":
        return str(traj.verifier_error)[:300]
    if reason in EPISODE_KINDS.values():
        return f"finish_reason {traj.finish_reason!r}"
    turns = [i for i, code in enumerate(traj.turn_status.tolist()) if TURN_KINDS.get(code) == reason]
    return f"turns {turns} of {len(traj.turn_status)}" if turns else f"all {len(traj.turn_status)} turns' tokens masked"


def _status_counts(batch: Iterable[Trajectory]) -> np.ndarray:
    counts = np.zeros(256, dtype=np.int64)
    for traj in batch:
        counts += np.bincount(traj.turn_status, minlength=256)
    return counts


def turn_counts(batch: Iterable[Trajectory]) -> dict[str, int]:
    """Abnormal turns in ``batch`` by status name (every name of :data:`TURN_STATUS` but ``ok`` and
    the tool-call errors, which :func:`tool_call_counts` reports; zeros included)."""
    counts = _status_counts(batch)
    return {name: int(counts[code]) for code, name in TURN_STATUS.items()
            if code != TURN_OK and code not in TOOL_CALL_ERRORS}


def tool_call_counts(batch: Iterable[Trajectory]) -> dict[str, int]:
    """Turns in ``batch`` with a malformed tool call, by reason (every reason of
    :data:`TOOL_CALL_ERRORS`, zeros included): metrics.jsonl ``tool_call_errors``."""
    counts = _status_counts(batch)
    return {reason: int(counts[code]) for code, reason in TOOL_CALL_ERRORS.items()}


def finish_counts(batch: Iterable[Trajectory]) -> dict[str, int]:
    """Episodes in ``batch`` by ``finish_reason`` (only the reasons present)."""
    return dict(Counter(t.finish_reason for t in batch))
