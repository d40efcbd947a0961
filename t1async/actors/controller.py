"""Controller role: admission control (bounded staleness), task assignment, rollout supervision and scaling.

Admission: ``rollout.admission``'s rule (t1async/rollout/admission.py, where the rules and their
guarantees are described) over the counts of an :class:`~t1async.rollout.admission_ledger.AdmissionLedger`,
held under one lock shared by every rollout actor and the learner. Task order:
:class:`t1async.rollout.task_order.TaskOrder`; the learner saves :meth:`task_order_state` with each
checkpoint, and a resumed launch passes it back as ``task_order``.

Supervision (the actors: t1async/rollout/fleet.py): :meth:`run` watches every rollout actor's ``run``
call, replaces one that crashes (up to ``max_restarts``) and follows :meth:`scale`; :meth:`stop` ends
admission, waits a grace period, then kills what is still running.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from loguru import logger

from t1async.actors import killed_for_memory
from t1async.config import RolloutConfig
from t1async.rollout.admission_ledger import AdmissionLedger
from t1async.rollout.fleet import RolloutFleet
from t1async.rollout.task_order import TaskOrder


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
        resumed: on a resumed run, the resumed learner's status (``timeline_version``, ``trained``,
            ``to_replay``), where admission starts (:class:`AdmissionLedger`); None: a new run.
    """

    def __init__(self, cfg: RolloutConfig, task_names: list[str], *, rollouts_per_version: int, max_staleness: int,
                 make_rollout: Callable[[int, int], Any], seed: int = 0, sampler_urls: list[str] | None = None,
                 task_order: dict[str, Any] | None = None, resumed: dict[str, Any] | None = None):
        if not task_names:
            raise ValueError("the controller needs at least one task")
        self.cfg = cfg
        self.ledger = AdmissionLedger(cfg.admission, rollouts_per_version, max_staleness, resumed=resumed)
        self.make_rollout = make_rollout
        self.crashes = 0
        self.memory_kills = 0  # rollout actors Ray's memory monitor killed (replaced; not crashes)
        self._order = TaskOrder.continued(task_names, cfg.group_size, seed, task_order)
        self._cond = threading.Condition()
        self._stopping = False
        self.fleet = RolloutFleet(cfg.num_actors)  # the rollout actors: t1async/rollout/fleet.py
        self._actors, self._retired = self.fleet.actors, self.fleet.retired  # (the same dict and set)
        self._sampler_urls = list(sampler_urls) if sampler_urls is not None else None

    # ---- called by rollout actors and the learner (concurrently) ------------------------
    def _locked(self, method: Callable[..., Any], *args: Any) -> Any:
        """``method(*args)`` of the ledger under the lock, then wake the actors waiting for admission."""
        with self._cond:
            out = method(*args)
            self._cond.notify_all()
            return out

    def acquire(self, actor_id: int) -> str | None:
        """Admit one episode: a task name, ``""`` (not yet: ask again: waits up to 1 s first), or None
        (stop). Asking again means the actor's previous episode is over (finished and reported, or failed)."""
        with self._cond:
            self.ledger.running.pop(actor_id, None)
            deadline = time.monotonic() + 1.0
            while True:
                if self._stopping or actor_id in self._retired:
                    return None
                if self.ledger.admit(actor_id):
                    return self._order.draw()
                left = deadline - time.monotonic()
                if left <= 0:
                    return ""
                self._cond.wait(left)

    def oldest_version(self) -> int:
        """The version admission counts from: the oldest episode not yet consumed, or the learner's
        version (:meth:`t1async.rollout.admission_ledger.AdmissionLedger.oldest_version`)."""
        return self._locked(self.ledger.oldest_version)

    def holds_publish(self) -> bool:
        """Whether the learner must ask :meth:`publish_allowed` before each publish (``learner_wait``)."""
        return self.ledger.rule.holds_publish

    def publish_allowed(self, next_version: int, held_ids: list[str]) -> bool:
        """Under ``rollout.admission: learner_wait``: may the learner publish ``next_version``?
        False while an episode it does not hold yet (``held_ids`` are those it holds) would become
        too stale to train. Always True under the other rules."""
        return self._locked(self.ledger.publish_allowed, next_version, held_ids)

    def episode_finished(self, actor_id: int, trajectory_id: str, extra_ids: list[str] | tuple[str, ...] = ()) -> None:
        """The actor's running episode became trajectory ``trajectory_id`` (called before it is
        sent); ``extra_ids``: more segments of the same episode (t1async/rollout/endpoint/agent.py), each
        with an admission slot of its own."""
        self._locked(self.ledger.finished, actor_id, trajectory_id, extra_ids)

    def trajectories_consumed(self, trajectory_ids: list[str]) -> None:
        """The learner trained on these trajectories: they no longer hold admission back."""
        self._locked(self.ledger.consumed, trajectory_ids)

    def episode_failed(self, actor_id: int, reason: str, agent: str = "builtin") -> None:
        """An admitted episode produced no trajectory: count it and return its admission slot.
        ``reason``: ``"<ExceptionType>: message"`` (t1async/rollout/episode.py), counted by its key (the text
        before the first colon) and ``agent`` (drawn for it) in :meth:`status` (and so in summary.json)."""
        self._locked(self.ledger.failed, actor_id, reason, agent)
        logger.warning("rollout {} lost an episode ({}): {}", actor_id, agent, reason)

    def trajectory_discarded(self, reason: str, trajectory_id: str | None = None) -> None:
        """A trajectory was dropped (too stale: the learner says so) or rejected (invalid: its rollout
        actor says so, once per trajectory): return its admission slot."""
        self._locked(self.ledger.discard, trajectory_id)
        logger.debug("learner discarded a trajectory: {}", reason)

    def set_version(self, version: int) -> None:
        """The learner published ``version``, a timeline version (t1async/learner/timeline.py; a
        resumed learner reports its checkpoint's, which may be lower: :meth:`AdmissionLedger.set_version
        <t1async.rollout.admission_ledger.AdmissionLedger.set_version>`); admit rollouts accordingly."""
        self._locked(self.ledger.set_version, version)

    def set_live(self, changes: dict[str, Any]) -> None:
        """Change ``max_staleness`` (eta) or ``tasks`` (names; the order is reshuffled) live."""
        with self._cond:
            if "max_staleness" in changes:
                self.ledger.max_staleness = int(changes["max_staleness"])
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
        """The samplers rollout actors may use now (asked at each episode's start and when a sampler is
        unavailable: t1async.sampling.sampler_client.RoutedSampler); None: the actors keep their own list."""
        with self._cond:
            return list(self._sampler_urls) if self._sampler_urls is not None else None

    def scale(self, num_actors: int) -> None:
        """Set the number of rollout actors; the supervision loop starts or retires actors to match."""
        if num_actors < 0:
            raise ValueError(f"num_actors must be >= 0, got {num_actors}")
        with self._cond:
            self.fleet.target = num_actors
        logger.info("rollout actors scaled to {}", num_actors)

    def status(self) -> dict[str, Any]:
        """Actor count, admissions, failures (in all and by reason key), crashes, the version admission
        follows, and ``tasks_drawn`` (episodes the task order has drawn, over every life of the run)."""
        with self._cond:
            detail = [{"id": aid, "state": "retiring" if aid in self._retired else
                       "running" if aid in self.ledger.running else "waiting",
                       **self.ledger.actor(aid), "started_at": self.fleet.started_at.get(aid)}
                      for aid in sorted(self._actors)]
            admission = self.ledger.status()
        return {"actors_detail": detail, "tasks": len(self._order.tasks), "tasks_drawn": self._order.drawn,
                "actors": len(self._actors), "target": self.fleet.target, **admission, "crashes": self.crashes,
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
                self.fleet.remove(aid)
                self.ledger.forget(aid)
                try:
                    result = ray.get(ref)
                    logger.info("rollout {} finished: {}", aid, result)
                except Exception as e:
                    if self._stopping:
                        continue
                    memory = killed_for_memory(e)  # Ray's memory monitor: not the actor's fault (the launch backs off)
                    self.memory_kills += memory
                    self.crashes += not memory
                    self._locked(self.ledger.lost, aid)  # its running episode is lost: its slot returned
                    logger.error("rollout actor {} crashed ({} of {} restarts): {}", aid, self.crashes,
                                 self.cfg.max_restarts, str(e).splitlines()[0] if str(e) else type(e).__name__)
                    if self.crashes > self.cfg.max_restarts:
                        logger.error("too many rollout crashes; the controller stops admitting episodes")
                        self.stop(grace_s=0)
        return self.status()

    def _reconcile(self, me: Any) -> None:
        """Follow the target (:meth:`RolloutFleet.plan <t1async.rollout.fleet.RolloutFleet.plan>`):
        kill at once the retired actors never admitted an episode (a scale-down cancels what a
        scale-up left pending), start the missing ones a few per tick."""
        import ray  # (ray: deferred, as in run)

        with self._cond:
            kill, start = self.fleet.plan(self.ledger.never_admitted)
        for aid, handle in kill:
            self.ledger.forget(aid)
            ray.kill(handle, no_restart=True)
        if kill:
            logger.info("scale-down: {} rollout actors without a running episode stopped at once", len(kill))
        for aid in start:
            handle = self.make_rollout(aid, self.cfg.crash_after_episodes if aid == 0 else 0)
            self.fleet.add(aid, handle, handle.run.remote(me))
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
