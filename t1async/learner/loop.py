"""The learner's training loop: take kept trajectories, train, publish, record, checkpoint.

Data path (one process; the learner role, t1async/actors/learner.py, builds the pieces):

    inbox (t1async/transport/inbox.py: received, validated, stored, ACKed, queued) --(keep or drop:
    staleness and abnormal ends, t1async/learner/keep.py; a batch of ``batch_size``,
    t1async/learner/batching.py)--> one update (t1async/learner/update.py) --> every
    ``publish_every`` steps: the next weight version to the samplers (t1async/learner/publisher.py)
    --> metrics.jsonl, transcripts, checkpoints (t1async/learner/checkpoints.py: weights + the ids
    they consumed, renamed into place atomically).

:meth:`TrainingLoop.run` returns after ``max_steps`` or when the shared stop event is set; either
way a final checkpoint is written. A resumed loop (:meth:`TrainingLoop.resume`) starts at its
checkpoint's step and timeline version and first replays the receive log's trajectories that
checkpoint had not consumed. A full disk pauses it (t1async/learner/disk_pause.py); a step that
raises because of a trajectory quarantines it and runs again without it (t1async/learner/step_guard.py).
Every dropped or refused trajectory is counted by reason, marked consumed (-1) and its admission
slot returned to the controller.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

from loguru import logger

from t1async.config import LearnerConfig, ModelConfig
from t1async.fileio import DiskGuard
from t1async.learner.abnormal import DROP_REASONS
from t1async.learner.backend import LearnerBackend
from t1async.learner.batching import HeldTrajectories, collect_batch
from t1async.learner.checkpoints import read_trainer_state, write_checkpoint
from t1async.learner.disk_pause import DiskPause
from t1async.learner.keep import keep_or_drop
from t1async.learner.metrics import MetricsFile, batch_metrics
from t1async.learner.publisher import Publisher
from t1async.learner.step_guard import StepGuard, refuse_in_step
from t1async.learner.timeline import TIMELINE_FILE, SampledTimelines, VersionTimeline
from t1async.learner.update import advantage_estimates, policy_lr, train_step
from t1async.rollout.transcripts import write_transcripts
from t1async.trajectory import Trajectory
from t1async.transport.delivery import ConsumedLedger, ReceiveLog
from t1async.transport.inbox import Inbox
from t1async.transport.quarantine import Quarantine


class TrainingLoop:
    """Train on what the inbox delivers; publish and checkpoint as configured.

    Args:
        cfg: learner settings (steps, batch, staleness bound, publication and checkpoint periods).
        model_cfg: policy architecture (``num_experts`` for routing replay).
        backend: the models and optimisers (t1async/learner/backend.py).
        publisher: weight versions and publication (t1async/learner/publisher.py).
        log: the receive log (its trajectories are replayed on resume; consumed ones dropped at each checkpoint).
        run_dir: the run directory (checkpoints/, episodes/).
        quarantine: refused trajectories (a resume skips those stored in the receive log).
        disk: the run directory's disk guard.
        metrics: metrics.jsonl.
        pause: the disk pause shared with the publisher.
        stopped: set to stop training (:meth:`run` then writes a final checkpoint).
        renderer: the tokenizer that renders transcripts (None: ``episodes_per_step`` 0).

    The inbox is given by :meth:`start` (it shares :attr:`consumed`, :attr:`counters` and
    :attr:`rejected_by`, which :meth:`resume` may replace first).
    """

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, backend: LearnerBackend, *, publisher: Publisher,
                 log: ReceiveLog, run_dir: Path, quarantine: Quarantine, disk: DiskGuard, metrics: MetricsFile,
                 pause: DiskPause, stopped: threading.Event, renderer: Any = None):
        self.cfg, self.model_cfg, self.backend, self.publisher = cfg, model_cfg, backend, publisher
        self.log, self.run_dir, self.quarantine, self.disk = log, run_dir, quarantine, disk
        self._metrics, self._pause, self._stop, self._tok = metrics, pause, stopped, renderer
        self.inbox: Inbox | None = None
        self.step = 0
        self._sampled = SampledTimelines()  # timeline version of each taken, untrained trajectory's oldest token
        self._held = HeldTrajectories()  # received, kept, not yet trained (rollout.admission: learner_wait)
        self._hold_publish = False
        self.counters = {"received": 0, "rejected": 0, "dropped_stale": 0, "dropped_stale_restart": 0, "trained": 0,
                         "duplicates": 0, "replayed": 0, "quarantine_evicted": 0}
        self.rejected_by: dict[str, int] = {}  # refused trajectories by reason (the field at fault; step_failed)
        self._guard = StepGuard(backend, cfg, num_experts=model_cfg.num_experts)  # probe and retry a failed step
        self.dropped = dict.fromkeys(DROP_REASONS, 0)  # trajectories dropped, by reason (cumulative)
        self._task_rewards: dict[str, list[tuple[int, float]]] = {}  # advantage: group (step, reward) per task, recent
        self._consumed = ConsumedLedger()  # trajectory id -> step that trained it (-1: dropped), bounded
        self.resumed: dict[str, Any] | None = None  # what a resume restored (status() reports it)
        self._controller: Any = None
        self._pending_discards: list[tuple[str, str]] = []  # (reason, trajectory id)
        self._discard_lock = threading.Lock()
        self._checkpoint_due = False  # a checkpoint a full disk refused, written once space is back
        self.checkpoint_failed: str | None = None  # why the last checkpoint was not written (None: it was)
        self._saved_step: int | None = None

    version = property(lambda self: self.publisher.version, doc="The last weight version published.")
    timeline_version = property(lambda self: self.publisher.timeline_version, doc="The learner's timeline version.")
    timeline = property(lambda self: self.publisher.timeline, doc="Weight version -> timeline version.")
    consumed = property(lambda self: self._consumed, doc="Trajectory id -> step that trained it (-1: dropped).")

    # ---- start ---------------------------------------------------------------------------
    def resume(self, path: Path | None, set_aside: list[str]) -> None:
        """Restore checkpoint ``path`` (critic, optimisers, step, versions, counters, consumed ids,
        the group advantage's recent rewards per task; the policy was loaded by the backend);
        None: no checkpoint yet, start at step 0 and replay the whole receive log. metrics.jsonl
        rows past the restored step are dropped; receive-log records already quarantined count as
        consumed. ``set_aside``: the corrupt checkpoints moved aside (reported in :attr:`resumed`).

        The learner resumes at the checkpoint's timeline version (t1async/learner/timeline.py,
        read from ``receive_log/timeline.json``), not at the last weight version published: the
        receive log's backlog and the episodes in flight are then judged, and admission runs, as
        if the lost steps had not been lost (the backlog re-trains them)."""
        pub, log = self.publisher, self.log
        pub.timeline = VersionTimeline.load(log.dir / TIMELINE_FILE)
        st = None
        version = timeline_version = 0
        if path is not None:
            if not self.backend.load_state(path):
                logger.warning("{}/optimizers.pt holds another learner backend's or another parallel layout's optimiser "
                               "state: the weights resume, the optimisers start fresh", path)
            st = read_trainer_state(path, pub.timeline, publish_every=self.cfg.publish_every)
            self.step, version, timeline_version = st.step, st.version, st.timeline_version
            self._consumed, self._task_rewards = st.consumed, st.group_rewards
            self.counters.update({k: v for k, v in st.counters.items() if k in self.counters})
            self.dropped.update(st.dropped)
            self.rejected_by.update(st.rejected_by)
        pub.restore(version, timeline_version, st.weights_published if st is not None else None)
        self._metrics.trim(self.step)
        self.resumed = {"checkpoint": str(path) if path else None, "step": self.step, "version": self.version,
                        "timeline_version": self.timeline_version,
                        "consumed": len(self._consumed),
                        "to_replay": sum(k not in self._consumed for k in log.keys())}
        logger.info("resumed from {} at step {}, version {} (timeline version {}): {} trajectories consumed, {} in "
                    "the receive log", path or "no checkpoint", self.step, self.version, self.timeline_version,
                    len(self._consumed), len(log))
        self.resumed["set_aside"] = set_aside  # (announced by the launch: t1async/service/launch.py)
        # receive-log records refused after they were stored (replay, step) are never replayed
        self._consumed.update((k, -1) for k in self.quarantine.ids() if k in log)

    def start(self, inbox: Inbox) -> None:
        """Take ``inbox`` and start it: the receive log's unconsumed records are replayed before the socket."""
        self.inbox = inbox
        inbox.start([k for k in self.log.keys() if k not in self._consumed])
        (self.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)

    def status(self) -> dict[str, Any]:
        """Step, weight and timeline version, queue depth, counters, dropped trajectories by reason,
        refused ones by reason (``rejected_by``), what a resume restored, and the consumed-id ledger's
        size (ids in all, streams, holes), and ``disk``: None, or why intake and training are
        paused (``disk full at PATH (N MB free)``), with ``disk_paused_s``; ``checkpoint_failed``: why
        the last checkpoint was not written (None: it was; after :meth:`run`, the final one)."""
        return {"step": self.step, "version": self.version, "timeline_version": self.timeline_version,
                "queue_depth": self.inbox.queue.qsize() + len(self._held),
                "queue_bytes": self.inbox.queue.nbytes, **self.counters, "dropped": dict(self.dropped),
                "rejected_by": dict(self.rejected_by),
                "resumed": self.resumed, "max_steps": self.cfg.max_steps,
                "disk": self.disk.check(), "disk_paused_s": round(self._pause.paused_s, 1),
                "checkpoint_failed": self.checkpoint_failed,
                "refused_handshakes": dict(self.inbox.receiver.refused_handshakes),
                "weight_group": self.publisher.status(),
                "ledger": {"consumed": len(self._consumed), "streams": len(self._consumed.marks),
                           "holes": self._consumed.holes(), "others": len(self._consumed.others)}}

    def _discard(self, reason: str, trajectory_id: str) -> None:
        """Give a dropped trajectory's admission slot back to the controller
        (held until :meth:`run` receives the controller)."""
        with self._discard_lock:
            self._pending_discards.append((reason, trajectory_id))
            if self._controller is None:
                return
            pending, self._pending_discards = self._pending_discards, []
        for r, tid in pending:
            try:
                self._controller.trajectory_discarded(r, tid)
            except Exception as e:  # the controller may be gone at shutdown; never crash the learner
                logger.warning("could not tell the controller about a discarded trajectory: {}", e)

    # ---- main loop ----------------------------------------------------------------------
    def run(self, controller: Any = None) -> dict[str, Any]:
        """Train for ``max_steps`` steps (or until the stop event is set), publishing and checkpointing.

        Args:
            controller: optional object whose methods are called plainly (the learner role adapts a
                Ray handle: t1async/actors/__init__.py :class:`Plain`), with ``set_version(v)`` (told the timeline
                version after each publication and on resume, so admission control follows the
                learner; t1async/learner/timeline.py),
                ``trajectories_consumed(ids)`` (after each step), ``trajectory_discarded(reason,
                trajectory_id)`` (each drop); optional ``holds_publish()``, ``publish_allowed(v, ids)``
                (``learner_wait``) and ``task_order_state()`` (saved with each checkpoint).

        Returns:
            Final :meth:`status`.
        """
        with self._discard_lock:
            self._controller = controller
            pending, self._pending_discards = self._pending_discards, []
        self._hold_publish = controller is not None and hasattr(controller, "holds_publish") and bool(
            controller.holds_publish())
        if controller is not None:
            if self.resumed is not None or self.timeline_version > 0:  # admission follows the restored
                controller.set_version(self.timeline_version)  # timeline version (it may go back)
            for reason, tid in pending:
                controller.trajectory_discarded(reason, tid)
        try:
            while (not self.cfg.max_steps or self.step < self.cfg.max_steps) and not self._stop.is_set():
                t_wait = time.perf_counter()
                self._pause.wait()
                if self._stop.is_set():
                    break
                batch = self._collect_batch()
                if batch is None:
                    break
                t0 = time.perf_counter()
                wait_s, publish_s = t0 - t_wait, 0.0
                metrics = self._guarded_step(batch)  # (batch loses what it quarantines)
                if metrics is None:  # every trajectory of it was quarantined: no step
                    continue
                staleness = [max(0, self._staleness(t)) for t in batch]  # (< 0: sampled on a lost life's branch)
                self.publisher.weights_published = False  # the policy moved past the last version published
                self.step += 1
                self._consumed.update((t.trajectory_id, self.step) for t in batch)
                for t in batch:
                    self._sampled.forget(t.trajectory_id)
                if controller is not None:  # admission stops waiting for these (oldest-episode rule)
                    controller.trajectories_consumed([t.trajectory_id for t in batch])
                if self.step % self.cfg.publish_every == 0:
                    t_pub = time.perf_counter()
                    self.publisher.publish(self.step, advance=True)
                    publish_s = time.perf_counter() - t_pub
                    if controller is not None:
                        controller.set_version(self.timeline_version)
                self.counters["trained"] += len(batch)
                metrics.update(batch_metrics(batch, staleness, self.cfg.abnormal, step=self.step, version=self.version,
                                             timeline_version=self.timeline_version, counters=self.counters,
                                             dropped=self.dropped, rejected_by=self.rejected_by,
                                             queue_depth=self.inbox.queue.qsize()))
                if publish_s:  # samplers paused by this publish, and the group re-formed before it (seconds)
                    sync = self.publisher.sync
                    metrics["publish_pause_s"], metrics["publish_form_s"] = sync.last_pause_s, sync.last_form_s
                metrics["step_s"] = time.perf_counter() - t0  # train + publish (seconds)
                metrics["batch_wait_s"], metrics["publish_s"] = wait_s, publish_s  # idle: waiting for the batch
                metrics["hold_s"] = self._held.hold_s  # of batch_wait_s: held for a slow episode (learner_wait)
                metrics["tokens_per_s"] = metrics.pop("trained_tokens") / metrics["step_s"]
                self._metrics.write(metrics)
                self._write_transcripts(batch)
                if self._checkpoint_due or (self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0):
                    self._checkpoint()
        finally:
            self._metrics.flush()
            if self._saved_step != self.step:
                self._checkpoint(final=True)  # (any failure: one line; a resume starts from the last one written)
            self._stop.set()
        return self.status()

    def _sampled_timeline(self, traj: Trajectory) -> int:
        """Timeline version of ``traj``'s oldest sampled token (t1async/learner/timeline.py
        :class:`SampledTimelines`), kept until it is trained or dropped."""
        return self._sampled.of(self.timeline, traj)

    def _staleness(self, traj: Trajectory) -> int:
        """Learner's timeline version - :meth:`_sampled_timeline`: a restart does not change it;
        negative for a trajectory a lost life sampled with weights not re-trained to yet."""
        return self._sampled.staleness(self.timeline, self.timeline_version, traj)

    def _keep(self, traj: Trajectory) -> bool:
        """Whether ``traj`` may be trained (:func:`t1async.learner.keep.keep_or_drop`: within the
        staleness bound, :meth:`_staleness`, and not to be dropped for an abnormal end); otherwise
        it is dropped (:meth:`_drop`) and counted (``dropped_stale``, and ``dropped_stale_restart``
        for a stale drop sampled in part by an earlier life's weights or a new timeline segment)."""
        drop = keep_or_drop(traj, staleness=self._staleness(traj), max_staleness=self.cfg.max_staleness,
                            timeline_version=self.timeline_version,
                            earlier_lives_version=self.publisher.earlier_lives_version,
                            segment_starts=[v for v, _ in self.timeline.starts], abnormal=self.cfg.abnormal)
        if drop is None:
            return True
        if drop.reason == "stale":
            self.counters["dropped_stale"] += 1
            self.counters["dropped_stale_restart"] += drop.restart
        self._drop(traj, drop.reason, drop.detail)
        return False

    def _collect_batch(self) -> list[Trajectory] | None:
        """Take ``batch_size`` trajectories that :meth:`_keep` keeps, in arrival order (under
        ``rollout.admission: learner_wait``, :meth:`_collect_held_batch`); t1async/learner/batching.py."""
        if self._hold_publish:
            return self._collect_held_batch()
        return collect_batch(self.cfg.batch_size, self.cfg.batch_timeout_s, receive=self._receive, stopped=self._stop,
                             paused_s=lambda: self._pause.paused_s)

    def _receive(self) -> Trajectory | None:
        """The next received trajectory that :meth:`_keep` keeps, waiting up to 0.5 s; None when
        none came (samplers waiting to join are served meanwhile) or it was dropped; waits first
        while the disk is full (t1async/learner/disk_pause.py)."""
        if self.disk.check() is not None:
            self._pause.wait()
            return None
        self._take_refused()
        try:
            traj = self.inbox.queue.get(timeout=0.5)
        except queue.Empty:
            if self.publisher.serve_joiners(self.step) and self._controller is not None:
                self._controller.set_version(self.timeline_version)
            return None
        return traj if self._keep(traj) else None

    def _take_refused(self) -> None:
        """Count the receive-log records refused after they were stored (on replay, or by a failed
        step: :meth:`t1async.transport.inbox.Inbox.refuse_stored`) as consumed (-1) and return
        their admission slots."""
        for tid in self.inbox.take_refused():
            self._consumed[tid] = -1
            self._discard("quarantined: refused after it was stored", tid)

    def _collect_held_batch(self) -> list[Trajectory] | None:
        """``rollout.admission: learner_wait``: the ``batch_size`` oldest trajectories received, taken
        once the controller allows the publish that follows this step (t1async/learner/batching.py
        :class:`HeldTrajectories`). None: stopped or starved."""
        return self._held.collect(
            self.cfg.batch_size, self.cfg.batch_timeout_s, publishes=(self.step + 1) % self.cfg.publish_every == 0,
            next_version=self.timeline_version + 1, keep=self._keep, order=self._sampled_timeline,
            allowed=lambda ids: self._controller.publish_allowed(self.timeline_version + 1, ids),
            receive=self._receive, stopped=self._stop, paused_s=lambda: self._pause.paused_s)

    def _drop(self, traj: Trajectory, reason: str, detail: str) -> None:
        """Never train ``traj``: count it under ``reason``, mark its id consumed (-1: a resend or a
        resume does not bring it back) and return its admission slot (:meth:`_discard`)."""
        self.dropped[reason] += 1
        self._consumed[traj.trajectory_id] = -1
        self._sampled.forget(traj.trajectory_id)
        self._discard(f"{reason}: {detail}", traj.trajectory_id)
        logger.warning("dropped trajectory {} of {}: {} ({})", traj.trajectory_id, traj.task, reason, detail)

    def _guarded_step(self, batch: list[Trajectory]) -> dict[str, Any] | None:
        """:meth:`_train_step`; when it raises, the trajectories to blame are quarantined
        (:meth:`_refuse_in_step`), removed from ``batch`` (in place) and the step retried
        without them (t1async/learner/step_guard.py :class:`StepGuard`). None: every one was
        quarantined. Raises RuntimeError when the fault is not the data's."""
        return self._guard.run(batch, self._train_step, self._refuse_in_step, step=self.step)

    def _refuse_in_step(self, traj: Trajectory, err: Exception) -> None:
        """Quarantine a trajectory that made a step fail (``rejected_by["step_failed"]``; a resume
        skips it): consumed (-1) and its admission slot returned."""
        refuse_in_step(self.inbox, traj, err)
        self._take_refused()

    def _train_step(self, batch: list[Trajectory]) -> dict[str, Any]:
        """One update on ``batch`` (:func:`t1async.learner.update.train_step`) with this learner's
        step, learning rate (:func:`~t1async.learner.update.policy_lr`) and per-episode advantage
        estimates (:func:`~t1async.learner.update.advantage_estimates`, which then remember the
        batch's rewards per task for the next ``group_window_steps`` steps)."""
        estimates, self._task_rewards = advantage_estimates(batch, self.cfg, self._task_rewards, self.step + 1)
        return train_step(batch, self.backend, self.cfg, num_experts=self.model_cfg.num_experts, step=self.step,
                          policy_lr=policy_lr(self.cfg, self.step), estimates=estimates)

    def _write_transcripts(self, batch: list[Trajectory]) -> None:
        """This step's episode transcripts (t1async/rollout/transcripts.py); a full disk skips them (logged)."""
        try:
            write_transcripts(self.run_dir / "episodes", self.step, batch, self.cfg.episodes_per_step, self._tok)
        except OSError as e:
            if not self.disk.fault(e, self.run_dir / "episodes"):
                raise
            logger.error("transcripts of step {} not written: {}", self.step, e)

    def _checkpoint(self, final: bool = False) -> bool:
        """:meth:`save_checkpoint`; on a full or failing disk, one line instead of a crash, and the
        checkpoint is due again after the next step once space is back (a resume meanwhile starts
        from the last checkpoint written and the receive log: nothing lost). ``final``: the run's
        last checkpoint, whose every failure (a bug too, its traceback in the log) is reported in
        :attr:`checkpoint_failed` instead of raised: the launch then ends with one line and exit
        status 1, not a Ray traceback. Returns whether it was written."""
        try:
            self.save_checkpoint()
        except Exception as e:
            kind = self.disk.fault(e, self.run_dir / "checkpoints", writing=True)
            if kind is None:
                if not final:
                    raise
                logger.exception("the final checkpoint of step {} raised", self.step)
            self._checkpoint_due = True
            now, text = self.disk.check(), (e.strerror if isinstance(e, OSError) and e.strerror else str(e))
            self.checkpoint_failed = (f"checkpoint of step {self.step} not written ({(text.splitlines() or [''])[0][:300]})"
                                      + (f": {now}" if kind and now else f": {type(e).__name__}"))
            logger.error("{}", self.checkpoint_failed)
            return False
        self._checkpoint_due, self.checkpoint_failed = False, None
        return True

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_NNNNNN/`` atomically (t1async/learner/checkpoints.py
        :func:`write_checkpoint`): policy safetensors + config.json, critic, optimisers, trainer
        state (with the group advantage's recent rewards per task), ``consumed.json`` (every
        trajectory id this model state trained on or dropped) and ``task_order.json`` (the
        controller's task order now, so that a resumed run continues it); then rotate old ones.

        Raises:
            OSError: ENOSPC when the disk is full or failing (the fault is recorded in ``self.disk``).
        """
        self._take_refused()
        controller = self._controller
        keeps_order = controller is not None and hasattr(controller, "task_order_state")
        path = write_checkpoint(
            self.run_dir / "checkpoints", self.step, backend=self.backend, consumed=self._consumed,
            trainer_state={"step": self.step, "version": self.version, "timeline_version": self.timeline_version,
                           "weights_published": self.publisher.weights_published, **self.counters, "dropped": self.dropped,
                           "rejected_by": self.rejected_by, "group_rewards": self._task_rewards},
            task_order=controller.task_order_state if keeps_order else None, disk=self.disk,
            fsync=self.inbox.log.fsync, keep_last=self.cfg.keep_checkpoints, keep_every=self.cfg.keep_every,
            note_in=self.inbox.log.dir)
        self.inbox.log.drop_consumed(self._consumed)
        self._saved_step = self.step
        logger.info("checkpoint written to {}", path)
        return path
