"""Controller role: admission control (bounded staleness), task assignment, rollout supervision and scaling.

Admission follows ``rollout.admission``, one of the rules in :mod:`t1async.rollout.admission`
(where they and their guarantees are described); this role keeps the counts they read, under one
lock shared by every rollout actor and the learner. Episodes are tracked by the rollout actor while they run
(:meth:`acquire`) and by trajectory id from :meth:`episode_finished` until the learner reports
them consumed (:meth:`trajectories_consumed`), dropped or rejected (:meth:`trajectory_discarded`). Episodes
that fail, and trajectories the learner drops or rejects, return their slot:
otherwise the learner could wait for data that admission will never allow (a deadlock). Each is
reported once, by the side that knows it was admitted: a failed episode and a rejected
trajectory by the rollout actor that ran it (the learner cannot tell an actor's invalid
trajectory from a stranger's garbage or a resent rejection), a stale drop by the learner (it
drops each trajectory id at most once).

Task order: :class:`t1async.rollout.task_order.TaskOrder` (a shuffled round robin); the learner saves
its :meth:`task_order_state` with each checkpoint and a resumed launch passes it back as ``task_order``,
so a resumed run continues the stream from the checkpoint instead of replaying its head.

Supervision: :meth:`run` watches every rollout actor's ``run`` call; an actor that crashes is
logged and replaced (up to ``max_restarts``), and the actor count follows :meth:`scale`.
:meth:`stop` ends admission, waits a grace period, then kills what is still running.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from loguru import logger

from t1async.actors import killed_for_memory
from t1async.config import RolloutConfig
from t1async.rollout.admission import ADMISSION_RULES, may_start, publish_allowed, resumed_admissions
from t1async.rollout.task_order import TaskOrder

START_PER_TICK = 4
"""Rollout actors the supervision loop starts per tick (about a second) at most."""


class Controller:
    """The controller actor (a plain class; ``ray.remote`` with ``max_concurrency`` > actors is applied in launch).

    Args:
        cfg: rollout section (actor count, restarts, fault injection).
        task_names: tasks to draw episodes from (shuffled round robin, each ``cfg.group_size``
            times in a row).
        rollouts_per_version: trajectories the learner consumes per published weight version
            (batch size x ``publish_every``).
        max_staleness: eta, the staleness bound.
        make_rollout: ``(actor_id, crash_after_episodes) -> Ray actor handle`` of a RolloutActor.
        seed: seed of the task order.
        task_order: where to continue the task order from (:meth:`task_order_state` as saved in
            the checkpoint a resumed learner restored; None: from its head).
        sampler_urls: samplers rollout actors are routed to (those holding weights; kept live by the
            launch's sampler pool through :meth:`set_samplers`).
        resumed: on a resumed run, the resumed learner's ``timeline_version``, ``trained`` and
            ``to_replay`` (its status): admission starts at that version and counts what the
            learner trained and will replay as started
            (:func:`t1async.rollout.admission.resumed_admissions`); None: a new run.
    """

    def __init__(self, cfg: RolloutConfig, task_names: list[str], *, rollouts_per_version: int, max_staleness: int,
                 make_rollout: Callable[[int, int], Any], seed: int = 0, sampler_urls: list[str] | None = None,
                 task_order: dict[str, Any] | None = None, resumed: dict[str, Any] | None = None):
        if not task_names:
            raise ValueError("the controller needs at least one task")
        self.cfg = cfg
        self.rollouts_per_version, self.max_staleness = rollouts_per_version, max_staleness
        self.make_rollout = make_rollout
        self.version = int(resumed["timeline_version"]) if resumed else 0
        self.started = resumed_admissions(resumed["trained"], resumed["to_replay"]) if resumed else 0
        self.failed_episodes = 0
        self.failures: dict[str, int] = {}  # failed episodes by short reason key (see episode_failed)
        self.discarded = 0
        self.crashes = 0
        self.memory_kills = 0  # rollout actors Ray's memory monitor killed (replaced; not crashes)
        self.target = cfg.num_actors
        self._order = TaskOrder(task_names, cfg.group_size, seed)
        if task_order is not None:
            try:
                note = self._order.restore(task_order)
                logger.log("WARNING" if note else "INFO", "task order continued after episode {} (pass {}){}",
                           self._order.drawn, self._order.passes, f": {note}" if note else "")
            except ValueError as e:  # (a resume is not refused over its task order)
                self._order = TaskOrder(task_names, cfg.group_size, seed)
                logger.error("the saved task order cannot be continued ({}): it starts over from its head", e)
        self._cond = threading.Condition()
        self._stopping = False
        self._actors: dict[int, tuple[Any, Any]] = {}  # actor_id -> (handle, run ObjectRef)
        self._retired: set[int] = set()
        self._next_id = 0
        self._running: dict[int, int] = {}  # actor_id -> admission version of its running episode
        self._episodes: dict[int, int] = {}  # actor_id -> episodes admitted (status)
        self._started_at: dict[int, float] = {}  # actor_id -> time.time() it was started (status)
        self._first_episode: dict[int, float] = {}  # actor_id -> time.time() of its first admission
        self._pending: dict[str, int] = {}  # trajectory id -> admission version, until consumed/discarded
        self._sampler_urls = list(sampler_urls) if sampler_urls is not None else None

    # ---- called by rollout actors and the learner (concurrently) ------------------------
    def acquire(self, actor_id: int) -> str | None:
        """Admit one episode: a task name, ``""`` (not yet: ask again), or None (stop).

        Waits up to 1 s for admission to open before answering ``""``. Asking again means the
        actor's previous episode is over (finished and reported, or failed).
        """
        with self._cond:
            self._running.pop(actor_id, None)
            deadline = time.monotonic() + 1.0
            while True:
                if self._stopping or actor_id in self._retired:
                    return None
                if may_start(self.started, self.oldest_version(), self.max_staleness, self.rollouts_per_version):
                    self.started += 1
                    self._running[actor_id] = self.version
                    self._episodes[actor_id] = self._episodes.get(actor_id, 0) + 1
                    self._first_episode.setdefault(actor_id, time.time())
                    return self._order.draw()
                left = deadline - time.monotonic()
                if left <= 0:
                    return ""
                self._cond.wait(left)

    def oldest_version(self) -> int:
        """The admission version of the oldest episode not yet consumed by the learner (running or
        finished), or the learner's version when there is none or it is older; always the
        learner's version under ``rollout.admission: learner_version`` (AReaL's rule)."""
        with self._cond:
            return ADMISSION_RULES[self.cfg.admission].base_version(
                self.version, [*self._running.values(), *self._pending.values()])

    def holds_publish(self) -> bool:
        """Whether the learner must ask :meth:`publish_allowed` before each publish (the
        ``learner_wait`` rule: admission runs ahead, the learner holds the bound)."""
        return ADMISSION_RULES[self.cfg.admission].holds_publish

    def publish_allowed(self, next_version: int, held_ids: list[str]) -> bool:
        """Under ``rollout.admission: learner_wait``: may the learner publish ``next_version``?
        False while an episode the learner does not hold yet (running, or finished and on its
        way; ``held_ids`` are those it holds and judges itself) was admitted at a version ``a``
        with ``next_version - a > max_staleness``: publishing would make it too stale to train,
        so the learner waits for it instead of dropping it. Always True under the other rules."""
        with self._cond:
            if not ADMISSION_RULES[self.cfg.admission].holds_publish:
                return True
            skip = set(held_ids)
            versions = [*self._running.values(), *(a for tid, a in self._pending.items() if tid not in skip)]
            return publish_allowed(next_version, versions, self.max_staleness)

    def episode_finished(self, actor_id: int, trajectory_id: str, extra_ids: list[str] | tuple[str, ...] = ()) -> None:
        """The actor's running episode became trajectory ``trajectory_id`` (called before it is
        sent): it stays the oldest-version candidate until the learner consumes or discards it.

        ``extra_ids``: more trajectories of the same episode (the exact segments of an external
        agent that broke its history, t1async/rollout/agent.py). Each takes an admission slot of
        its own (the learner trains trajectories, not episodes) and is tracked like the first, so
        a discarded segment returns exactly the slot it took."""
        with self._cond:
            version = self._running.pop(actor_id, None)
            if version is not None:
                self._pending[trajectory_id] = version
                for tid in extra_ids:
                    self._pending[tid] = version
                self.started += len(extra_ids)

    def trajectories_consumed(self, trajectory_ids: list[str]) -> None:
        """The learner trained on these trajectories: they no longer hold admission back."""
        with self._cond:
            for tid in trajectory_ids:
                self._pending.pop(tid, None)
            self._cond.notify_all()

    def episode_failed(self, actor_id: int, reason: str) -> None:
        """An admitted episode produced no trajectory: count it and return its admission slot.

        ``reason`` is ``"<ExceptionType>: message"`` (t1async/rollout/episode.py); it is also counted by
        its key, the text before the first colon (``SandboxError``, ``TaskError``,
        ``SamplerError``...), in :meth:`status` ``episode_failures`` (and so in summary.json).
        """
        key = reason.split(":", 1)[0].strip()[:60] or "unknown"
        with self._cond:
            self._running.pop(actor_id, None)
            self.started -= 1
            self.failed_episodes += 1
            self.failures[key] = self.failures.get(key, 0) + 1
            self._cond.notify_all()
        logger.warning("rollout {} lost an episode: {}", actor_id, reason)

    def trajectory_discarded(self, reason: str, trajectory_id: str | None = None) -> None:
        """A trajectory was dropped (too stale: the learner says so) or rejected (invalid: its rollout
        actor says so, once per trajectory): return its admission slot."""
        with self._cond:
            if trajectory_id is not None:
                self._pending.pop(trajectory_id, None)
            self.started -= 1
            self.discarded += 1
            self._cond.notify_all()
        logger.debug("learner discarded a trajectory: {}", reason)

    def set_version(self, version: int) -> None:
        """The learner published ``version``, a timeline version (t1async/learner/timeline.py: the
        weight version in a run whose learner never restarted; a resumed learner reports its
        checkpoint's, which may be lower than the last one: admission then waits while it
        re-trains the steps it lost); admit rollouts accordingly.

        A version lower than the last one (a resume) also lowers to it the admission version of
        every episode admitted and not yet consumed: the resumed learner may have sent the samplers
        its checkpoint's weights, so an episode admitted at a later version may go on sampling at
        ``version`` (its oldest token, by which the learner measures staleness, is then that old),
        and ``learner_wait`` must hold the publishes that would make it too stale. Where the samplers
        kept newer weights this only makes the learner wait for those episodes a version earlier.
        (Measured: a soak whose learner was killed mid-publication dropped 2 such trajectories as
        stale, 3 > 2, before this rule.)"""
        with self._cond:
            if version < self.version:
                lowered = 0
                for table in (self._running, self._pending):
                    for key, admitted in table.items():
                        if admitted > version:
                            table[key] = version
                            lowered += 1
                if lowered:
                    logger.info("timeline version went back from {} to {} (a resumed learner): {} unconsumed "
                                "episodes now count from it", self.version, version, lowered)
            self.version = version
            self._cond.notify_all()

    def set_live(self, changes: dict[str, Any]) -> None:
        """Change ``max_staleness`` (eta) or ``tasks`` (names; the order is reshuffled) live."""
        with self._cond:
            if "max_staleness" in changes:
                self.max_staleness = int(changes["max_staleness"])
            if "tasks" in changes:
                if not changes["tasks"]:
                    raise ValueError("the controller needs at least one task")
                self._order.set_tasks(list(changes["tasks"]))
            self._cond.notify_all()
        logger.info("live change: {}", changes)

    def task_order_state(self) -> dict[str, Any]:
        """The task order's position now (:meth:`t1async.rollout.task_order.TaskOrder.state`),
        taken by the learner as it writes each checkpoint."""
        with self._cond:
            return self._order.state()

    def set_samplers(self, urls: list[str]) -> None:
        """The samplers rollout actors may use from now on: those holding the current weights,
        less any draining, dead or restarting (the launch's sampler pool keeps it)."""
        with self._cond:
            self._sampler_urls = list(urls)
        logger.info("rollout actors routed to samplers {}", urls)

    def sampler_urls(self) -> list[str] | None:
        """The samplers rollout actors may use now (each actor asks at the start of an episode
        and when its sampler is unavailable: t1async.sampling.sampler_client.RoutedSampler); None when
        never given (the actors keep the list they were started with)."""
        with self._cond:
            return list(self._sampler_urls) if self._sampler_urls is not None else None

    def scale(self, num_actors: int) -> None:
        """Set the number of rollout actors; the supervision loop starts or retires actors to match."""
        if num_actors < 0:
            raise ValueError(f"num_actors must be >= 0, got {num_actors}")
        with self._cond:
            self.target = num_actors
        logger.info("rollout actors scaled to {}", num_actors)

    def status(self) -> dict[str, Any]:
        """Actor count, admissions, failures (in all and by reason key), crashes, the version admission
        follows, and ``tasks_drawn`` (episodes the task order has drawn, over every life of the run)."""
        with self._cond:
            running, pending, oldest = len(self._running), len(self._pending), self.oldest_version()
            detail = [{"id": aid, "state": "retiring" if aid in self._retired else
                       "running" if aid in self._running else "waiting",
                       "version": self._running.get(aid), "episodes": self._episodes.get(aid, 0),
                       "started_at": self._started_at.get(aid), "first_episode_at": self._first_episode.get(aid)}
                      for aid in sorted(self._actors)]
        return {"actors_detail": detail, "max_staleness": self.max_staleness, "tasks": len(self._order.tasks),
                "tasks_drawn": self._order.drawn,
                "actors": len(self._actors), "target": self.target, "started": self.started, "version": self.version,
                "oldest_version": oldest, "running": running, "pending": pending,
                "failed_episodes": self.failed_episodes, "episode_failures": dict(self.failures),
                "discarded": self.discarded, "crashes": self.crashes,
                "memory_kills": self.memory_kills}

    # ---- supervision loop ---------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Start rollout actors, replace crashed ones, follow :meth:`scale`; returns when stopped."""
        import ray  # (ray: deferred; only the supervision loop, under Ray, needs it)

        me = ray.get_runtime_context().current_actor
        while not self._stopping:
            self._reconcile(me)
            refs = {ref: aid for aid, (_, ref) in self._actors.items()}
            if not refs:
                time.sleep(0.5)
                continue
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=1.0)
            for ref in ready:
                aid = refs[ref]
                self._actors.pop(aid, None)
                for per_actor in (self._episodes, self._started_at, self._first_episode):
                    per_actor.pop(aid, None)
                self._retired.discard(aid)
                try:
                    result = ray.get(ref)
                    logger.info("rollout {} finished: {}", aid, result)
                except Exception as e:
                    if self._stopping:
                        continue
                    memory = killed_for_memory(e)  # Ray's memory monitor: not the actor's fault (the launch backs off)
                    self.memory_kills += memory
                    self.crashes += not memory
                    with self._cond:  # its running episode is lost: return the slot, stop waiting for it
                        if self._running.pop(aid, None) is not None:
                            self.started -= 1
                        self._cond.notify_all()
                    logger.error("rollout actor {} crashed ({} of {} restarts): {}", aid, self.crashes,
                                 self.cfg.max_restarts, str(e).splitlines()[0] if str(e) else type(e).__name__)
                    if self.crashes > self.cfg.max_restarts:
                        logger.error("too many rollout crashes; the controller stops admitting episodes")
                        self.stop(grace_s=0)
        return self.status()

    def _reconcile(self, me: Any) -> None:
        """Retire actors past the target (one that ran an episode finishes it and stops at its
        next :meth:`acquire`; one never admitted an episode, pending in Ray's queue or waiting for
        its first admission, is killed at once: a scale-down cancels what a scale-up left pending)
        and start missing ones, at most :data:`START_PER_TICK` per call (a large scale-up is spread
        over ticks, so a scale-down or a stop meanwhile acts on few actors)."""
        import ray  # (ray: deferred, as in run)

        with self._cond:
            live = sorted(a for a in self._actors if a not in self._retired)
            for aid in live[self.target:]:
                self._retired.add(aid)  # finishes its current episode, then acquire() says stop
            idle = [aid for aid in self._retired  # never admitted: pending in Ray's queue, or starting
                    if aid in self._actors and aid not in self._running and aid not in self._first_episode]
            missing = min(self.target - min(len(live), self.target), START_PER_TICK)
        for aid in idle:  # it holds no episode and sent nothing of its own
            handle, _ = self._actors.pop(aid)
            self._retired.discard(aid)
            for per_actor in (self._episodes, self._started_at, self._first_episode):
                per_actor.pop(aid, None)
            ray.kill(handle, no_restart=True)
        if idle:
            logger.info("scale-down: {} rollout actors without a running episode stopped at once", len(idle))
        for _ in range(missing):
            aid = self._next_id
            self._next_id += 1
            crash = self.cfg.crash_after_episodes if aid == 0 else 0
            handle = self.make_rollout(aid, crash)
            self._actors[aid] = (handle, handle.run.remote(me))
            self._started_at[aid] = time.time()
            logger.info("started rollout actor {}", aid)

    def stop(self, grace_s: float = 5.0) -> dict[str, Any]:
        """End admission, wait up to ``grace_s`` for actors to finish their episode, kill the rest."""
        import ray  # (ray: deferred, as in run)

        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        actors = list(self._actors.values())
        if actors and grace_s > 0:
            ray.wait([ref for _, ref in actors], num_returns=len(actors), timeout=grace_s)
        for handle, _ in actors:
            ray.kill(handle, no_restart=True)
        return self.status()
