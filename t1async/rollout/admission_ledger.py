"""The counts admission reads (t1async/rollout/admission.py), kept per episode and per trajectory.

Episodes are tracked by the rollout actor while they run (:meth:`AdmissionLedger.admit`) and by
trajectory id from :meth:`AdmissionLedger.finished` until the learner reports them consumed
(:meth:`AdmissionLedger.consumed`), dropped or rejected (:meth:`AdmissionLedger.discarded`).
Episodes that fail, and trajectories the learner drops or rejects, return their slot: otherwise
the learner could wait for data that admission will never allow (a deadlock). Each is reported
once, by the side that knows it was admitted: a failed episode and a rejected trajectory by the
rollout actor that ran it, a stale drop by the learner (it drops each trajectory id at most once).

Not thread-safe: the controller role (t1async/actors/controller.py) calls it under its lock.
"""

from __future__ import annotations

import time

from loguru import logger

from t1async.rollout.admission import ADMISSION_RULES, may_start, publish_allowed, resumed_admissions


class AdmissionLedger:
    """Admission state of one run.

    Args:
        admission: ``rollout.admission``, a key of :data:`~t1async.rollout.admission.ADMISSION_RULES`.
        rollouts_per_version: trajectories the learner consumes per published version.
        max_staleness: eta, the staleness bound (changed live through :attr:`max_staleness`).
        resumed: on a resumed run, the resumed learner's ``timeline_version``, ``trained`` and
            ``to_replay``: admission starts at that version and counts what the learner trained and
            will replay as started (:func:`~t1async.rollout.admission.resumed_admissions`); None: a new run.

    Attributes:
        version: the learner's timeline version admission follows.
        started: episodes admitted and not returned (a failed episode or a discarded trajectory
            returns its slot; extra segments of one episode take one each).
        failed_episodes, failures, failures_by_agent: episodes that produced no trajectory, in all, by
            reason key and by the agent drawn for them.
        discarded: trajectories dropped or rejected.
        running: actor id -> admission version of its running episode.
        pending: trajectory id -> admission version, until consumed or discarded.
    """

    def __init__(self, admission: str, rollouts_per_version: int, max_staleness: int,
                 resumed: dict[str, int] | None = None):
        self.rule = ADMISSION_RULES[admission]
        self.rollouts_per_version, self.max_staleness = rollouts_per_version, max_staleness
        self.version = int(resumed["timeline_version"]) if resumed else 0
        self.started = resumed_admissions(resumed["trained"], resumed["to_replay"]) if resumed else 0
        self.failed_episodes = 0
        self.failures: dict[str, int] = {}
        self.failures_by_agent: dict[str, int] = {}
        self.discarded = 0
        self.running: dict[int, int] = {}
        self.pending: dict[str, int] = {}
        self._episodes: dict[int, int] = {}  # actor id -> episodes admitted (status)
        self._first_admitted: dict[int, float] = {}  # actor id -> time.time() of its first admission (status)

    def status(self) -> dict[str, object]:
        """``max_staleness``, ``started``, ``version``, ``oldest_version``, ``running`` and
        ``pending`` (counts), ``failed_episodes``, ``episode_failures`` (by reason key),
        ``episode_failures_by_agent``, ``discarded``."""
        return {"max_staleness": self.max_staleness, "started": self.started, "version": self.version,
                "oldest_version": self.oldest_version(), "running": len(self.running), "pending": len(self.pending),
                "failed_episodes": self.failed_episodes, "episode_failures": dict(self.failures),
                "episode_failures_by_agent": dict(self.failures_by_agent),
                "discarded": self.discarded}

    def admit(self, actor_id: int) -> bool:
        """Admit one episode of ``actor_id`` now if the rule allows (:func:`may_start`); whether it did."""
        if not may_start(self.started, self.oldest_version(), self.max_staleness, self.rollouts_per_version):
            return False
        self.started += 1
        self.running[actor_id] = self.version
        self._episodes[actor_id] = self._episodes.get(actor_id, 0) + 1
        self._first_admitted.setdefault(actor_id, time.time())
        return True

    def actor(self, actor_id: int) -> dict[str, object]:
        """``version`` (admission version of its running episode, None when none runs), ``episodes``
        (admitted), ``first_episode_at`` (time.time() of its first admission, None before)."""
        return {"version": self.running.get(actor_id), "episodes": self._episodes.get(actor_id, 0),
                "first_episode_at": self._first_admitted.get(actor_id)}

    def never_admitted(self, actor_id: int) -> bool:
        """Whether ``actor_id`` has no running episode and was never admitted one."""
        return actor_id not in self.running and actor_id not in self._first_admitted

    def forget(self, actor_id: int) -> None:
        """The actor is gone: drop its per-actor counts (not its running episode: :meth:`lost`)."""
        self._episodes.pop(actor_id, None)
        self._first_admitted.pop(actor_id, None)

    def oldest_version(self) -> int:
        """The version admission counts from (the rule's ``base_version`` over every episode not
        yet consumed: running, or finished and on its way)."""
        return self.rule.base_version(self.version, [*self.running.values(), *self.pending.values()])

    def publish_allowed(self, next_version: int, held_ids: list[str]) -> bool:
        """Whether the learner may publish ``next_version`` (always, unless the rule holds
        publishes: then not while an episode it does not hold, ``held_ids`` being those it holds,
        would become too stale)."""
        if not self.rule.holds_publish:
            return True
        skip = set(held_ids)
        versions = [*self.running.values(), *(a for tid, a in self.pending.items() if tid not in skip)]
        return publish_allowed(next_version, versions, self.max_staleness)

    def finished(self, actor_id: int, trajectory_id: str, extra_ids: list[str] | tuple[str, ...] = ()) -> None:
        """The actor's running episode became ``trajectory_id`` (and ``extra_ids``, more segments
        of one episode, each taking an admission slot of its own)."""
        version = self.running.pop(actor_id, None)
        if version is not None:
            self.pending[trajectory_id] = version
            for tid in extra_ids:
                self.pending[tid] = version
            self.started += len(extra_ids)

    def consumed(self, trajectory_ids: list[str]) -> None:
        """The learner trained on these trajectories."""
        for tid in trajectory_ids:
            self.pending.pop(tid, None)

    def failed(self, actor_id: int, reason: str, agent: str = "builtin") -> None:
        """An admitted episode produced no trajectory: return its slot; count it by ``reason``'s
        key, the text before the first colon (``SandboxError``, ``TaskError``...), and by ``agent``
        (the ``rollout.agent`` name drawn for it)."""
        key = reason.split(":", 1)[0].strip()[:60] or "unknown"
        self.running.pop(actor_id, None)
        self.started -= 1
        self.failed_episodes += 1
        self.failures[key] = self.failures.get(key, 0) + 1
        self.failures_by_agent[agent] = self.failures_by_agent.get(agent, 0) + 1

    def discard(self, trajectory_id: str | None) -> None:
        """A trajectory was dropped or rejected: return its slot."""
        if trajectory_id is not None:
            self.pending.pop(trajectory_id, None)
        self.started -= 1
        self.discarded += 1

    def lost(self, actor_id: int) -> None:
        """The actor died: its running episode (if any) returns its slot."""
        if self.running.pop(actor_id, None) is not None:
            self.started -= 1

    def set_version(self, version: int) -> None:
        """Follow the learner's timeline ``version``.

        A version lower than the last one (a resumed learner) also lowers to it the admission
        version of every episode admitted and not yet consumed: the resumed learner may have sent
        the samplers its checkpoint's weights, so an episode admitted at a later version may go on
        sampling at ``version`` (its oldest token, by which the learner measures staleness, is
        then that old), and ``learner_wait`` must hold the publishes that would make it too stale.
        Where the samplers kept newer weights this only makes the learner wait for those episodes
        a version earlier. (Measured: a soak whose learner was killed mid-publication dropped 2
        such trajectories as stale, 3 > 2, before this rule.)"""
        if version < self.version:
            lowered = 0
            for table in (self.running, self.pending):
                for key, admitted in table.items():
                    if admitted > version:
                        table[key] = version
                        lowered += 1
            if lowered:
                logger.info("timeline version went back from {} to {} (a resumed learner): {} unconsumed "
                            "episodes now count from it", self.version, version, lowered)
        self.version = version
