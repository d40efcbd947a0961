"""Learner role: pull trajectories, drop what is too stale, train the actor-critic, publish weights.

Data path (one process):

    inbox (t1async/transport/inbox.py: ZeroMQ ROUTER -> de-duplicate, decode + validate ->
    receive log, one flush per burst -> ACK -> bounded queue) --(run loop: staleness and
    abnormal-end filter (``learner.abnormal``, t1async/learner/abnormal.py), batch of
    ``batch_size``)--> one update (t1async/learner/update.py: critic values, advantages,
    decoupled-PPO update with routing replay) --> every ``publish_every`` steps: version + 1,
    broadcast to every sampler --> metrics.jsonl, checkpoints (weights + the ids they consumed,
    renamed into place atomically).

The inbox stops reading the socket while its queue is full, so the actors' send windows and
spools fill and their ``send`` waits (backpressure). ``run`` returns after ``max_steps`` or when
:meth:`stop` is called (Ctrl-C); either way a final checkpoint is written. With
``learner.resume`` the learner restarts from its latest checkpoint and first re-queues the
receive log's trajectories that checkpoint had not consumed: nothing lost, nothing trained twice
(the exact guarantee is in t1async/transport/delivery.py).

A full or failing disk (below ``learner.disk_floor_mb`` free, or a write refused with ENOSPC/EIO:
t1async/fileio.py ``DiskGuard``) pauses the learner instead of crashing or hanging it: the inbox
stops ACKing (the actors keep their spools), no step runs, :meth:`Learner.status` says why
(``disk``), and once space is back it resumes by itself and writes what waited (metrics rows, a
due checkpoint). :meth:`Learner.stop` ends a pause at once.

Poison: the inbox refuses (REJ), counts by reason and quarantines every trajectory that breaks the
run's own facts (t1async/transport/intake.py), so none reaches a step. One that still makes a step
raise (a bug of ours) is found by running the step's forward passes on each trajectory alone
(:func:`t1async.learner.update.probe`), quarantined and skipped, and the step is retried without
it (t1async/learner/step_guard.py); a resume skips it (``quarantine/ids.txt``).
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from loguru import logger

from t1async.actors import call
from t1async.config import GenerationConfig, LearnerConfig, ModelConfig, TransportConfig, WeightSyncConfig
from t1async.fileio import DiskGuard
from t1async.learner.abnormal import DROP_REASONS, drop_detail, drop_reason
from t1async.learner.backend import LearnerBackend, make_backend
from t1async.learner.batching import HeldTrajectories, collect_batch
from t1async.learner.checkpoints import (
    checkpoint_bytes,
    read_trainer_state,
    resumable_checkpoint,
    resume_from_nothing,
    untrusted_checkpoints,
    write_checkpoint,
)
from t1async.learner.disk_pause import DiskPause
from t1async.learner.metrics import MetricsFile, batch_metrics
from t1async.learner.step_guard import StepGuard, refuse_in_step
from t1async.learner.timeline import TIMELINE_FILE, SampledTimelines, VersionTimeline
from t1async.learner.update import advantage_estimates, policy_lr, train_step
from t1async.models.families import load_renderer, sampler_weights
from t1async.models.logprobs import sampling_semantics
from t1async.rollout.transcripts import write_transcripts
from t1async.sampling.sampler_client import SamplerError, post_json, weight_version
from t1async.trajectory import Trajectory
from t1async.transport.delivery import ByteQueue, ConsumedLedger, ReceiveLog
from t1async.transport.inbox import Inbox
from t1async.transport.intake import RunFacts, context_limit
from t1async.transport.quarantine import Quarantine
from t1async.transport.transport import ZmqReceiver
from t1async.weights.factory import make_weight_sync
from t1async.weights.protocol import WeightSync, WeightSyncError


class Learner:
    """The learner actor (a plain class; ``ray.remote`` is applied in launch).

    Args:
        cfg: learner settings (steps, batch, staleness bound, PPO and GAE constants).
        model_cfg: policy architecture.
        transport: where to bind the trajectory socket, queue bounds, receive-log fsync, CURVE keys.
        weight_sync: how to broadcast weights.
        run_dir: run directory (metrics.jsonl, checkpoints/, quarantine/, receive_log/).
        generation: the samplers' temperature, top-k and top-p: the learner scores every sampled
            token under the distribution the samplers report (t1async/models/logprobs.py), so that
            log pi_prox, log pi_theta and the behaviour log mu are of one distribution. None: the
            defaults (temperature 1, no truncation).
        sampler_backend: ``sampler.backend``; picks the names and layout weights are published in
            (t1async/models/families.py ``sampler_weights``) and the log-prob semantics scored under
            (t1async.models.logprobs.sampling_semantics: ``embedded`` renormalised over the kept
            top-k/top-p set, ``sglang`` the full tempered softmax).
        seed: seed of the model init (the same init for every ``learner.backend``).
        torch_threads: intra-op threads of this process.
        max_context_tokens: ``env.max_context_tokens``: intake refuses a longer trajectory, and one
            past ``model.max_position_embeddings`` (t1async/transport/intake.py ``context_limit``).

    Raises:
        ValueError: ``generation.temperature`` is 0 (greedy samples have no density to train on),
            or ``sampler_backend`` is unknown.
    """

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, transport: TransportConfig,
                 weight_sync: WeightSyncConfig, run_dir: str, *, generation: GenerationConfig | None = None,
                 seed: int = 0, torch_threads: int = 1, sampler_backend: str = "embedded",
                 max_context_tokens: int = 0):
        self.generation = generation if generation is not None else GenerationConfig()
        semantics = sampling_semantics(sampler_backend)
        self._sampler_backend = sampler_backend
        if not self.generation.temperature > 0:
            raise ValueError(f"generation.temperature={self.generation.temperature} cannot be trained on: greedy "
                             "samples have no density (no gradient); use a temperature > 0 (greedy is for t1async eval)")
        torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self.cfg, self.model_cfg = cfg, model_cfg
        self.run_dir = Path(run_dir)
        # the newest checkpoint that verifies against its manifest; newer corrupt ones are moved aside
        resume_from, set_aside = resumable_checkpoint(self.run_dir / "checkpoints") if cfg.resume else (None, [])
        if cfg.resume and resume_from is None and (why := untrusted_checkpoints(self.run_dir / "checkpoints")):
            raise RuntimeError(f"cannot resume: {why}; starting again from the initial weights would throw the "
                               "run's training away: put an intact step_N folder back there, or start a new run")
        if cfg.resume and resume_from is None and (gone := resume_from_nothing(self.run_dir)):
            if not cfg.resume_from_scratch:
                raise RuntimeError(f"cannot resume: {gone}; add learner.resume_from_scratch=true to start over")
            logger.warning("resuming from the initial weights on purpose (learner.resume_from_scratch): {}", gone)
        # policy, critic, KL reference (the warm start, frozen, loaded from init_checkpoint so a
        # resumed run keeps it) and their optimisers: t1async/learner/backend.py
        self.backend: LearnerBackend = make_backend(cfg.backend, cfg, model_cfg, self.generation,
                                                    resume_from or cfg.init_checkpoint or None, semantics)
        self.version = 0
        self.step = 0
        # staleness is measured in timeline versions, which a restart does not advance
        # (t1async/learner/timeline.py); equal to the weight versions in a run that never resumed
        self.timeline = VersionTimeline()
        self.timeline_version = 0
        self._sampled = SampledTimelines()  # timeline version of each taken, untrained trajectory's oldest token
        self._earlier_lives_version = -1  # resumed: weight versions up to this one were published by earlier lives
        self._samplers_at = -1  # resumed: timeline version of the (lost life's) weights the samplers kept
        self._held = HeldTrajectories()  # received, kept, not yet trained (rollout.admission: learner_wait)
        self._hold_publish = False
        self.counters = {"received": 0, "rejected": 0, "dropped_stale": 0, "dropped_stale_restart": 0, "trained": 0,
                         "duplicates": 0, "replayed": 0, "quarantine_evicted": 0}
        self.rejected_by: dict[str, int] = {}  # refused trajectories by reason (the field at fault; step_failed)
        self._guard = StepGuard(self.backend, cfg, num_experts=model_cfg.num_experts)  # probe and retry a failed step
        self.dropped = dict.fromkeys(DROP_REASONS, 0)  # trajectories dropped, by reason (cumulative)
        self._task_rewards: dict[str, list[tuple[int, float]]] = {}  # advantage: group (step, reward) per task, recent
        self._consumed = ConsumedLedger()  # trajectory id -> step that trained it (-1: dropped), bounded
        log = ReceiveLog(self.run_dir / "receive_log", fsync=transport.log_fsync, reset=not cfg.resume)
        self.resumed: dict[str, Any] | None = None  # what a resume restored (status() reports it)
        self._republish_same = False  # resumed at a checkpoint whose weights are the last version published
        self._weights_published = False  # the policy's weights are those of the last version published
        self._sync_managed = False  # the launch's sampler pool sets the membership (set_samplers)
        self.quarantine = Quarantine(self.run_dir / "quarantine", prefix_bytes=transport.quarantine_prefix_bytes,
                                     max_bytes=transport.quarantine_max_bytes, max_files=transport.quarantine_max_files,
                                     fsync=transport.log_fsync == "always")
        self.disk = DiskGuard(self.run_dir, cfg.disk_floor_mb)  # a full disk pauses intake and training
        self.disk.reserve(checkpoint_bytes(resume_from) if resume_from else 0)  # (room for the next checkpoint)
        self._metrics = MetricsFile(self.run_dir / "metrics.jsonl", self.disk)  # (keeps rows a full disk refused)
        if cfg.resume:
            self._resume(resume_from, log)
            self.resumed["set_aside"] = set_aside  # (announced by the launch: t1async/service/launch.py)
            # receive-log records refused after they were stored (replay, step) are never replayed
            self._consumed.update((k, -1) for k in self.quarantine.ids() if k in log)
        backlog = [k for k in log.keys() if k not in self._consumed]  # replayed before the socket
        inbox_queue = ByteQueue(transport.recv_queue_messages or max(4 * cfg.batch_size, 8), transport.recv_queue_bytes)
        self._stop = threading.Event()  # training stops (stop(), or run() ended)
        self._controller: Any = None
        self._pending_discards: list[tuple[str, str]] = []  # (reason, trajectory id)
        self._discard_lock = threading.Lock()
        self._pause = DiskPause(self.disk, self._stop, on_space=self._metrics.flush)  # a full disk pauses the loop
        self._checkpoint_due = False  # a checkpoint a full disk refused, written once space is back
        self.checkpoint_failed: str | None = None  # why the last checkpoint was not written (None: it was)
        receiver = ZmqReceiver.from_config(transport)
        self._sync: WeightSync = make_weight_sync(weight_sync)  # weight_sync.mode: distributed or tensor
        # receive durability (socket -> receive log -> ACK -> queue): t1async/transport/inbox.py
        self.inbox = Inbox(receiver, log, inbox_queue, self._consumed, self.counters, run_dir=self.run_dir,
                           shape=(model_cfg.num_experts, model_cfg.routed_layers, model_cfg.num_experts_per_tok),
                           version=lambda: self.version, training_stopped=self._stop,
                           dump_trajectories=cfg.dump_trajectories, group_messages=transport.log_group_messages,
                           facts=RunFacts(vocab_size=model_cfg.vocab_size, num_experts=model_cfg.num_experts,
                                          num_layers=model_cfg.routed_layers, top_k=model_cfg.num_experts_per_tok,
                                          reward=cfg.reward, max_tokens=context_limit(
                                              model_cfg.max_position_embeddings, max_context_tokens)),
                           quarantine=self.quarantine, rejected_by=self.rejected_by,
                           disk=self.disk)
        self.inbox.start(backlog)
        (self.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        self._tok = load_renderer(model_cfg) if cfg.episodes_per_step else None
        logger.info("learner ({} backend): policy {:.2f} M parameters, trajectories at {}", cfg.backend,
                    self.backend.num_parameters() / 1e6, self.inbox.receiver.endpoint)

    # the backend's models and optimisers, by their names before the backends
    policy = property(lambda self: self.backend.policy)
    critic = property(lambda self: self.backend.critic)
    reference = property(lambda self: self.backend.reference)
    policy_opt = property(lambda self: self.backend.policy_opt)
    critic_opt = property(lambda self: self.backend.critic_opt)

    # ---- wiring -------------------------------------------------------------------------
    def endpoint(self) -> str:
        """ZeroMQ address rollout actors push trajectories to."""
        return self.inbox.receiver.endpoint

    def connect_samplers(self, urls: list[str]) -> int:
        """Form the weight group with every sampler and publish version 0; returns the version.

        A resumed learner whose samplers all still hold weights of an earlier life at or past its
        own timeline version (t1async/learner/timeline.py; the usual case after a kill: the
        samplers keep the last version the dead learner published) leaves them serving those
        and publishes nothing until its timeline has moved past them (:meth:`_publish`): the
        episodes in flight, and those started meanwhile, keep sampling weights as far along as
        before the kill instead of the checkpoint's older ones."""
        self._sync.connect(urls)
        if not self._keep_samplers_weights(urls):
            self._publish()
        return self.version

    def _keep_samplers_weights(self, urls: list[str]) -> bool:
        """Resumed: whether every sampler holds the last weight version this run started to
        publish (so that publication completed: only its last bucket sets the version,
        t1async/weights/distributed.py) and its timeline version is at least the learner's; if so
        each is sent ``/continue_generation`` (the dead learner may have paused it after the last
        bucket), they count as holding it (``WeightSync.held``) and :attr:`_samplers_at` is its
        timeline version. Otherwise (a sampler restarted or unreachable, a publication cut short)
        the checkpoint's weights are published, as a new version."""
        if self.resumed is None or not urls:
            return False
        last = self.inbox.log.published_version
        try:
            held = {u: int(weight_version(u, timeout_s=10)) for u in urls}
            if set(held.values()) != {last} or self.timeline.at(last) < self.timeline_version:
                return False
            for u in urls:
                post_json(u, "/continue_generation", {}, timeout_s=10)
        except (SamplerError, OSError, ValueError) as e:
            logger.info("resumed: the samplers' weight versions are unknown ({}); publishing the checkpoint's", e)
            return False
        at = self.timeline.at(last)
        self._sync.held.update(held)
        self._samplers_at, self._republish_same = at, False
        logger.info("resumed at timeline version {}: the samplers keep weight version {} (timeline version {}) "
                    "until the learner re-trains past it", self.timeline_version, last, at)
        return True

    def set_samplers(self, urls: list[str]) -> None:
        """The samplers to publish to from now on (the launch's sampler pool: live scaling, a
        restarted sampler). Departed ones leave the group at the next publish, which never waits
        for them. New ones get weights before they serve (:meth:`_serve_joiners`): at once, in a
        group of their own, while this learner waits for a batch and its weights are still the
        last version published; otherwise at the next publish (and at once, as a new version, when
        no other sampler serves: nothing else would ever reach that publish)."""
        self._sync_managed = True
        self._sync.set_members(urls)

    def stop(self) -> None:
        """Ask :meth:`run` to finish after the current step (it then writes a final checkpoint)."""
        self._stop.set()

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
                "weight_group": self._sync.snapshot(),
                "ledger": {"consumed": len(self._consumed), "streams": len(self._consumed.marks),
                           "holes": self._consumed.holes(), "others": len(self._consumed.others)}}

    def set_live(self, changes: dict[str, Any]) -> None:
        """Change live-safe settings (``lr``, ``max_staleness``, ``max_steps``; t1async/service/control.py):
        each is read afresh by the next step."""
        for key, value in changes.items():
            if key not in ("lr", "max_staleness", "max_steps"):
                raise ValueError(f"learner.{key} cannot change live")
            setattr(self.cfg, key, value)
        logger.info("live change: {}", changes)

    # ---- resume -------------------------------------------------------------------------
    def _resume(self, path: Path | None, log: ReceiveLog) -> None:
        """Restore checkpoint ``path`` (critic, optimisers, step, version, counters, consumed ids,
        the group advantage's recent rewards per task;
        the policy was loaded in ``__init__``); None: no checkpoint yet, start at step 0 and replay
        the whole receive log. metrics.jsonl rows past the restored step are dropped.

        The learner resumes at the checkpoint's timeline version (t1async/learner/timeline.py,
        read from ``receive_log/timeline.json``), not at the last weight version published: the
        receive log's backlog and the episodes in flight are then judged, and admission runs, as
        if the lost steps had not been lost (the backlog re-trains them)."""
        self.timeline = VersionTimeline.load(log.dir / TIMELINE_FILE)
        st = None
        if path is not None:
            if not self.backend.load_state(path):
                logger.warning("{}/optimizers.pt was written by another learner backend: optimisers start fresh", path)
            st = read_trainer_state(path, self.timeline, publish_every=self.cfg.publish_every)
            self.step, self.version, self.timeline_version = st.step, st.version, st.timeline_version
            self._consumed, self._task_rewards = st.consumed, st.group_rewards
            self.counters.update({k: v for k, v in st.counters.items() if k in self.counters})
            self.dropped.update(st.dropped)
            self.rejected_by.update(st.rejected_by)
        # Weights published after that checkpoint are lost: the next publication takes a new,
        # higher number (see _publish), so versions never repeat.
        # ...unless the checkpoint was written right after a publication and nothing was published
        # since: the samplers hold exactly these weights as this version, so it is sent again
        # unchanged (a restart then does not make every trajectory in flight one version staler).
        self._republish_same = st is not None and log.published_version == self.version and st.weights_published
        self.version = max(self.version, log.published_version)
        self._earlier_lives_version = self.version
        self._metrics.trim(self.step)
        self.resumed = {"checkpoint": str(path) if path else None, "step": self.step, "version": self.version,
                        "timeline_version": self.timeline_version,
                        "consumed": len(self._consumed),
                        "to_replay": sum(k not in self._consumed for k in log.keys())}
        logger.info("resumed from {} at step {}, version {} (timeline version {}): {} trajectories consumed, {} in "
                    "the receive log", path or "no checkpoint", self.step, self.version, self.timeline_version,
                    len(self._consumed), len(log))

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
                call(self._controller.trajectory_discarded, r, tid)
            except Exception as e:  # the controller may be gone at shutdown; never crash the learner
                logger.warning("could not tell the controller about a discarded trajectory: {}", e)

    # ---- main loop ----------------------------------------------------------------------
    def run(self, controller: Any = None) -> dict[str, Any]:
        """Train for ``max_steps`` steps (or until :meth:`stop`), publishing and checkpointing.

        Args:
            controller: optional object (or Ray handle) with ``set_version(v)`` (told the timeline
                version after each publication and on resume, so admission control follows the
                learner; t1async/learner/timeline.py),
                ``trajectories_consumed(ids)`` (after each step) and
                ``trajectory_discarded(reason, trajectory_id)`` (each stale drop).

        Returns:
            Final :meth:`status`.
        """
        with self._discard_lock:
            self._controller = controller
            pending, self._pending_discards = self._pending_discards, []
        self._hold_publish = controller is not None and hasattr(controller, "holds_publish") and bool(
            call(controller.holds_publish))
        if controller is not None:
            if self.resumed is not None or self.timeline_version > 0:  # admission follows the restored
                call(controller.set_version, self.timeline_version)  # timeline version (it may go back)
            for reason, tid in pending:
                call(controller.trajectory_discarded, reason, tid)
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
                self._weights_published = False  # the policy moved past the last version published
                self.step += 1
                self._consumed.update((t.trajectory_id, self.step) for t in batch)
                for t in batch:
                    self._sampled.forget(t.trajectory_id)
                if controller is not None:  # admission stops waiting for these (oldest-episode rule)
                    call(controller.trajectories_consumed, [t.trajectory_id for t in batch])
                if self.step % self.cfg.publish_every == 0:
                    t_pub = time.perf_counter()
                    self._publish(advance=True)
                    publish_s = time.perf_counter() - t_pub
                    if controller is not None:
                        call(controller.set_version, self.timeline_version)
                self.counters["trained"] += len(batch)
                metrics.update(batch_metrics(batch, staleness, self.cfg.abnormal, step=self.step, version=self.version,
                                             timeline_version=self.timeline_version, counters=self.counters,
                                             dropped=self.dropped, rejected_by=self.rejected_by,
                                             queue_depth=self.inbox.queue.qsize()))
                if publish_s:  # samplers paused by this publish, and the group re-formed before it (seconds)
                    metrics["publish_pause_s"], metrics["publish_form_s"] = self._sync.last_pause_s, self._sync.last_form_s
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
            if getattr(self, "_saved_step", None) != self.step:
                self._checkpoint()  # (a full disk: one line; a resume starts from the last one written)
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
        """Whether ``traj`` may be trained: within the staleness bound (:meth:`_staleness`) and not
        to be dropped for an abnormal end (:func:`t1async.learner.abnormal.drop_reason`);
        otherwise it is dropped and counted. A stale drop of a trajectory sampled (in part) by the
        weights of an earlier learner life, or by a publication that started a new timeline segment
        (a resume's or a joining sampler's: t1async/learner/timeline.py), also counts in
        ``dropped_stale_restart``."""
        staleness = self._staleness(traj)
        if staleness > self.cfg.max_staleness:
            self.counters["dropped_stale"] += 1
            sampled = traj.versions[traj.loss_mask.astype(bool)]
            if traj.min_version <= self._earlier_lives_version or bool(
                    np.isin(sampled, [v for v, _ in self.timeline.starts]).any()):
                self.counters["dropped_stale_restart"] += 1
            self._drop(traj, "stale", f"{staleness} > {self.cfg.max_staleness}: oldest sampled token at timeline "
                                      f"version {self.timeline_version - staleness} (weight versions {traj.min_version}.."
                                      f"{int(traj.versions.max())}), learner at {self.timeline_version}")
            return False
        reason = drop_reason(traj, self.cfg.abnormal)
        if reason is not None:
            self._drop(traj, reason, drop_detail(traj, reason))
            return False
        return True

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
            self._serve_joiners()
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
            allowed=lambda ids: call(self._controller.publish_allowed, self.timeline_version + 1, ids),
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

    def _publish(self, advance: bool = False) -> None:
        """Broadcast the policy to every sampler as the next version (version 0 at start).

        ``advance``: a regular publication (every ``publish_every`` steps): the timeline version
        advances by one. Otherwise (the first publication of a life, a joining sampler's) the
        weights are fewer than ``publish_every`` updates past the timeline version they keep,
        and the timeline gets a new start at this weight version, written before the broadcast
        (t1async/learner/timeline.py)."""
        if advance:
            self.timeline_version += 1
            if self.timeline_version <= self._samplers_at:  # (connect_samplers kept the samplers' weights)
                logger.info("timeline version {}: not published, the samplers hold weights as far along (timeline "
                            "version {})", self.timeline_version, self._samplers_at)
                return
        if (self.step > 0 or self.version > 0) and not self._republish_same:  # (version > 0 at step 0: resumed
            self.version += 1                                                  # before the first checkpoint)
        self._republish_same = False
        rebased = self.timeline.at(self.version) != self.timeline_version
        if rebased:
            self.timeline.rebase(self.version, self.timeline_version)
        if not self._note_published(save_timeline=rebased):
            logger.error("weight version {} not published: stopped while the disk was full", self.version)
            return
        self._weights_published = True
        t0 = time.perf_counter()
        try:
            self._sync.publish(self._published(), self.version)
        except WeightSyncError as e:
            # failed samplers are out of service (paused, never serving partial weights); carry on
            # while any sampler took the update, or while the launch's pool replaces failed
            # samplers (set_samplers), else this learner cannot publish at all
            if not self._sync_managed and not [u for u in self._sync.urls if u not in self._sync.failed]:
                raise
            logger.error("weight version {}: {}", self.version, e)
        logger.info("published weight version {} in {:.2f} s (samplers paused {:.2f} s)", self.version,
                    time.perf_counter() - t0, self._sync.last_pause_s)

    def _published(self):
        """The policy's tensors under the names and layout the samplers load (lazy views, one at a time)."""
        return sampler_weights(self.model_cfg, self.backend.hf_weights(), self._sampler_backend)

    def _serve_joiners(self) -> None:
        """Give new samplers weights while waiting for a batch (see :meth:`set_samplers`): the last
        version at once, in a group of their own, when the policy has not moved since it was
        published; a new version to everyone when it has and no other sampler serves."""
        joiners = self._sync.joiners()
        if not joiners:
            return
        if self._weights_published:
            t0 = time.perf_counter()
            try:
                self._sync.load(self._published(), self.version, joiners)
            except WeightSyncError as e:
                logger.error("{}", e)
                return
            logger.info("samplers {} joined with weight version {} in {:.2f} s (the others not paused)", joiners,
                        self.version, time.perf_counter() - t0)
        elif not [u for u in self._sync.members() if u in self._sync.held]:
            logger.warning("no sampler holds weights: publishing the policy as a new version for {}", joiners)
            self._publish()
            if self._controller is not None:
                call(self._controller.set_version, self.timeline_version)

    def _note_published(self, save_timeline: bool) -> bool:
        """Record durably that ``self.version`` is being published, and with ``save_timeline`` the
        timeline's new start (before the broadcast: a version number is never reused); on a full
        disk wait for space and try again. False: stopped while waiting (nothing is broadcast)."""
        todo = {"timeline": save_timeline}

        def record() -> None:
            if todo["timeline"]:
                self.timeline.save(self.inbox.log.dir / TIMELINE_FILE, fsync=self.inbox.log.fsync)
                todo["timeline"] = False
            self.inbox.log.note_published(self.version)

        return self._pause.retry(record, self.inbox.log.dir, f"weight version {self.version}")

    def _write_transcripts(self, batch: list[Trajectory]) -> None:
        """This step's episode transcripts (t1async/rollout/transcripts.py); a full disk skips them (logged)."""
        try:
            write_transcripts(self.run_dir / "episodes", self.step, batch, self.cfg.episodes_per_step, self._tok)
        except OSError as e:
            if not self.disk.fault(e, self.run_dir / "episodes"):
                raise
            logger.error("transcripts of step {} not written: {}", self.step, e)

    def _checkpoint(self) -> bool:
        """:meth:`save_checkpoint`; on a full or failing disk, one line instead of a crash, and the
        checkpoint is due again after the next step once space is back (a resume meanwhile starts
        from the last checkpoint written and the receive log: nothing lost). Returns whether it was written."""
        try:
            self.save_checkpoint()
        except Exception as e:
            if not self.disk.fault(e, self.run_dir / "checkpoints"):
                raise
            self._checkpoint_due = True
            self.checkpoint_failed = (f"checkpoint of step {self.step} not written ({str(e).splitlines()[0][:200]}): "
                                      f"{self.disk.check() or 'disk fault'}")
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
                           "weights_published": self._weights_published, **self.counters, "dropped": self.dropped,
                           "rejected_by": self.rejected_by, "group_rewards": self._task_rewards},
            task_order=(lambda: call(controller.task_order_state)) if keeps_order else None, disk=self.disk,
            fsync=self.inbox.log.fsync, keep_last=self.cfg.keep_checkpoints, keep_every=self.cfg.keep_every,
            note_in=self.inbox.log.dir)
        self.inbox.log.drop_consumed(self._consumed)
        self._saved_step = self.step
        logger.info("checkpoint written to {}", path)
        return path

    def close(self) -> None:
        """Stop the receive thread, close the socket, and stop the backend's other ranks (if any)."""
        self._stop.set()
        self.inbox.close()
        self._sync.close()
        self.backend.close()  # (the megatron backend's expert-parallel ranks)
