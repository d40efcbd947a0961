"""Learner role: wire the training loop, its inbox and its publisher to Ray.

The pieces (each in its wing, this module only builds and connects them):

- inbox (t1async/transport/inbox.py): the ZeroMQ ROUTER, de-duplication, decode + validate
  against the run's facts (t1async/transport/intake.py; refused ones quarantined, REJ), the
  receive log (one flush per burst) before each ACK, a bounded queue (backpressure: a full queue
  stops reading the socket, so the actors' send windows and spools fill and their ``send`` waits);
- training loop (t1async/learner/loop.py): keep or drop each trajectory (staleness, abnormal ends:
  t1async/learner/keep.py), batches, one update per step, metrics, transcripts, checkpoints, a
  full disk's pause, a failing step's probe and retry;
- publisher (t1async/learner/publisher.py): weight and timeline versions, broadcast to the
  samplers (t1async/weights/), samplers joining.

``run`` returns after ``max_steps`` or when :meth:`Learner.stop` is called (Ctrl-C); either way a
final checkpoint is written. With ``learner.resume`` the learner restarts from its latest
checkpoint that verifies and first re-queues the receive log's trajectories that checkpoint had
not consumed: nothing lost, nothing trained twice (t1async/transport/delivery.py).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from t1async.actors import Plain
from t1async.config import GenerationConfig, LearnerConfig, ModelConfig, TransportConfig, WeightSyncConfig
from t1async.fileio import DiskGuard
from t1async.learner.backend import make_backend
from t1async.learner.checkpoints import checkpoint_bytes, resumable_checkpoint, resume_from_nothing, untrusted_checkpoints
from t1async.learner.disk_pause import DiskPause
from t1async.learner.loop import TrainingLoop
from t1async.learner.metrics import MetricsFile
from t1async.learner.publisher import Publisher
from t1async.models.families import load_renderer, sampler_weights
from t1async.models.logprobs import sampling_semantics
from t1async.transport.delivery import ByteQueue, ReceiveLog
from t1async.transport.inbox import Inbox
from t1async.transport.intake import RunFacts, context_limit
from t1async.transport.quarantine import Quarantine
from t1async.transport.transport import ZmqReceiver
from t1async.weights.factory import make_weight_sync

_READS = ("step", "version", "timeline_version", "timeline", "counters", "dropped", "rejected_by", "resumed",
          "backend", "inbox", "quarantine", "disk")
"""The training loop's state this role lets callers read (status pages, tests): read-only."""


class Learner:
    """The learner actor (a plain class; ``ray.remote`` is applied in launch).

    ``loop`` (:class:`~t1async.learner.loop.TrainingLoop`) trains; ``publisher``
    (:class:`~t1async.learner.publisher.Publisher`) publishes; the names in :data:`_READS` and
    the backend's models and optimisers read through to them.

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
        RuntimeError: ``learner.resume`` and every checkpoint fails to verify, or the run's
            checkpoints are gone and ``learner.resume_from_scratch`` is not set.
    """

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, transport: TransportConfig,
                 weight_sync: WeightSyncConfig, run_dir: str, *, generation: GenerationConfig | None = None,
                 seed: int = 0, torch_threads: int = 1, sampler_backend: str = "embedded",
                 max_context_tokens: int = 0):
        self.generation = generation if generation is not None else GenerationConfig()
        semantics = sampling_semantics(sampler_backend)
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
        backend = make_backend(cfg.backend, cfg, model_cfg, self.generation, resume_from or cfg.init_checkpoint or None,
                               semantics)
        log = ReceiveLog(self.run_dir / "receive_log", fsync=transport.log_fsync, reset=not cfg.resume)
        quarantine = Quarantine(self.run_dir / "quarantine", prefix_bytes=transport.quarantine_prefix_bytes,
                                max_bytes=transport.quarantine_max_bytes, max_files=transport.quarantine_max_files,
                                fsync=transport.log_fsync == "always")
        disk = DiskGuard(self.run_dir, cfg.disk_floor_mb)  # a full disk pauses intake and training
        disk.reserve(checkpoint_bytes(resume_from) if resume_from else 0)  # (room for the next checkpoint)
        metrics = MetricsFile(self.run_dir / "metrics.jsonl", disk)  # (keeps rows a full disk refused)
        self._stop = threading.Event()  # training stops (stop(), or run() ended)
        pause = DiskPause(disk, self._stop, on_space=metrics.flush)  # a full disk pauses the loop

        def published():  # the policy under the names and layout the samplers load (lazy views, one at a time)
            return sampler_weights(model_cfg, backend.hf_weights(), sampler_backend)

        self.publisher = Publisher(make_weight_sync(weight_sync), published, log, pause)
        self.loop = TrainingLoop(cfg, model_cfg, backend, publisher=self.publisher, log=log, run_dir=self.run_dir,
                                 quarantine=quarantine, disk=disk, metrics=metrics, pause=pause, stopped=self._stop,
                                 renderer=load_renderer(model_cfg) if cfg.episodes_per_step else None)
        if cfg.resume:
            self.loop.resume(resume_from, set_aside)
        inbox_queue = ByteQueue(transport.recv_queue_messages or max(4 * cfg.batch_size, 8), transport.recv_queue_bytes)
        # receive durability (socket -> receive log -> ACK -> queue): t1async/transport/inbox.py
        facts = RunFacts(vocab_size=model_cfg.vocab_size, num_experts=model_cfg.num_experts,
                         num_layers=model_cfg.routed_layers, top_k=model_cfg.num_experts_per_tok, reward=cfg.reward,
                         max_tokens=context_limit(model_cfg.max_position_embeddings, max_context_tokens))
        self.loop.start(Inbox(ZmqReceiver.from_config(transport), log, inbox_queue, self.loop.consumed,
                              self.loop.counters, run_dir=self.run_dir,
                              shape=(model_cfg.num_experts, model_cfg.routed_layers, model_cfg.num_experts_per_tok),
                              version=lambda: self.publisher.version, training_stopped=self._stop,
                              dump_trajectories=cfg.dump_trajectories, group_messages=transport.log_group_messages,
                              facts=facts, quarantine=quarantine, rejected_by=self.loop.rejected_by, disk=disk))
        logger.info("learner ({} backend): policy {:.2f} M parameters, trajectories at {}", cfg.backend,
                    backend.num_parameters() / 1e6, self.inbox.receiver.endpoint)

    # the backend's models and optimisers, by their names before the backends
    policy = property(lambda self: self.backend.policy)
    critic = property(lambda self: self.backend.critic)
    reference = property(lambda self: self.backend.reference)
    policy_opt = property(lambda self: self.backend.policy_opt)
    critic_opt = property(lambda self: self.backend.critic_opt)

    def endpoint(self) -> str:
        """ZeroMQ address rollout actors push trajectories to."""
        return self.inbox.receiver.endpoint

    def connect_samplers(self, urls: list[str]) -> int:
        """Form the weight group with every sampler and publish version 0 (a resumed learner may
        leave the samplers the weights they hold: :meth:`Publisher.connect
        <t1async.learner.publisher.Publisher.connect>`); returns the weight version."""
        self.publisher.connect(urls, self.loop.step)
        return self.publisher.version

    def set_samplers(self, urls: list[str]) -> None:
        """The samplers to publish to from now on (the launch's sampler pool: live scaling, a
        restarted sampler). New ones get weights before they serve: at once, in a group of their
        own, while this learner waits for a batch and its weights are still the last version
        published; otherwise at the next publish (and at once, as a new version, when no other
        sampler serves). :meth:`Publisher.set_members <t1async.learner.publisher.Publisher.set_members>`."""
        self.publisher.set_members(urls)

    def run(self, controller: Any = None) -> dict[str, Any]:
        """Train until ``max_steps`` or :meth:`stop` (:meth:`TrainingLoop.run
        <t1async.learner.loop.TrainingLoop.run>`); ``controller``: a plain object or a Ray handle
        of the controller role. Returns the final :meth:`status`."""
        return self.loop.run(Plain(controller) if controller is not None else None)

    def stop(self) -> None:
        """Ask :meth:`run` to finish after the current step (it then writes a final checkpoint)."""
        self._stop.set()

    def status(self) -> dict[str, Any]:
        """:meth:`TrainingLoop.status <t1async.learner.loop.TrainingLoop.status>`: step, versions,
        queue depth, counters, drops and refusals by reason, the resume, the disk, the last
        checkpoint's failure, refused handshakes, the weight group, the consumed-id ledger."""
        return self.loop.status()

    def set_live(self, changes: dict[str, Any]) -> None:
        """Change live-safe settings (``lr``, ``max_staleness``, ``max_steps``; t1async/service/control.py):
        each is read afresh by the next step.

        Raises:
            ValueError: any other key.
        """
        for key, value in changes.items():
            if key not in ("lr", "max_staleness", "max_steps"):
                raise ValueError(f"learner.{key} cannot change live")
            setattr(self.cfg, key, value)
        logger.info("live change: {}", changes)

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_NNNNNN/`` now (:meth:`TrainingLoop.save_checkpoint
        <t1async.learner.loop.TrainingLoop.save_checkpoint>`).

        Raises:
            OSError: ENOSPC when the disk is full or failing.
        """
        return self.loop.save_checkpoint()

    def close(self) -> None:
        """Stop the receive thread, close the socket, and stop the backend's other ranks (if any)."""
        self._stop.set()
        self.inbox.close()
        self.publisher.close()
        self.backend.close()  # (the megatron backend's expert-parallel ranks)


for _name in _READS:
    setattr(Learner, _name, property(lambda self, _n=_name: getattr(self.loop, _n), doc=f"The training loop's ``{_name}``."))
