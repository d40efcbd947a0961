"""Learner role: pull trajectories, drop what is too stale, train the actor-critic, publish weights.

Data path (one process):

    ZeroMQ PULL --(receive thread: decode + validate; bad frames counted and quarantined)-->
    bounded queue --(run loop: staleness filter, batch of ``batch_size``)--> critic values, GAE
    --> decoupled-PPO update with routing replay --> every ``publish_every`` steps: version + 1,
    broadcast to every sampler --> metrics.jsonl, checkpoints.

The receive thread blocks on the bounded queue when training falls behind, so ZeroMQ's
high-water marks push back on the rollout actors. ``run`` returns after ``max_steps`` or when
:meth:`stop` is called (Ctrl-C); either way a final checkpoint is written.
"""

from __future__ import annotations

import copy
import json
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from loguru import logger
from safetensors.torch import save_file

from t1async.actors import call
from t1async.config import LearnerConfig, ModelConfig, TransportConfig, WeightSyncConfig
from t1async.model import Qwen3MoeForCausalLM
from t1async.rl import gae, policy_loss, token_logprobs, value_loss
from t1async.trajectory import Trajectory, TrajectoryError, decode
from t1async.transport import ZmqReceiver, make_endpoint
from t1async.weight_sync import DistributedWeightSync

MAX_QUARANTINED_FILES = 100


class ValueModel(nn.Module):
    """Critic: a Qwen3-MoE trunk (warm-started from the policy's weights) with a scalar head.

    ``forward(input_ids [B, T]) -> values [B, T]`` float32: the value of the state after
    reading ``input_ids[:, :t+1]``, i.e. before the token at position t + 1 is sampled.
    The critic routes with its own router (it has its own weights; replaying the policy's
    routing would be meaningless for it).
    """

    def __init__(self, policy: Qwen3MoeForCausalLM):
        super().__init__()
        self.backbone = copy.deepcopy(policy)
        self.head = nn.Linear(policy.cfg.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids).hidden
        return self.head(hidden.float()).squeeze(-1)


class Learner:
    """The learner actor (a plain class; ``ray.remote`` is applied in launch).

    Args:
        cfg: learner settings (steps, batch, staleness bound, PPO and GAE constants).
        model_cfg: policy architecture.
        transport: where to bind the trajectory socket.
        weight_sync: how to broadcast weights.
        run_dir: run directory (metrics.jsonl, checkpoints/, quarantine/).
        seed: seed of the model init.
        torch_threads: intra-op threads of this process.
    """

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, transport: TransportConfig,
                 weight_sync: WeightSyncConfig, run_dir: str, *, seed: int = 0, torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self.cfg, self.model_cfg = cfg, model_cfg
        self.run_dir = Path(run_dir)
        if cfg.init_checkpoint:
            self.policy = Qwen3MoeForCausalLM.from_pretrained(cfg.init_checkpoint)
            if self.policy.cfg != model_cfg:
                raise ValueError(f"learner.init_checkpoint {cfg.init_checkpoint} has a model config that differs from `model`")
        else:
            self.policy = Qwen3MoeForCausalLM(model_cfg)
        self.critic = ValueModel(self.policy)
        self.policy_opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic_lr, weight_decay=cfg.weight_decay)
        self.version = 0
        self.step = 0
        self.counters = {"received": 0, "rejected": 0, "dropped_stale": 0, "trained": 0}
        self._queue: queue.Queue[Trajectory] = queue.Queue(maxsize=max(4 * cfg.batch_size, 8))
        self._stop = threading.Event()
        self._controller: Any = None
        self._pending_discards: list[str] = []
        self._discard_lock = threading.Lock()
        self._receiver = ZmqReceiver(make_endpoint(transport.scheme, transport.host, transport.port), rcvhwm=transport.rcvhwm)
        self._sync = DistributedWeightSync(weight_sync.backend, weight_sync.master_address, weight_sync.master_port,
                                           weight_sync.timeout_s)
        self._recv_thread = threading.Thread(target=self._receive_loop, name="learner-recv", daemon=True)
        self._recv_thread.start()
        (self.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        self._metrics_path = self.run_dir / "metrics.jsonl"
        n_params = sum(p.numel() for p in self.policy.parameters())
        logger.info("learner: policy {:.2f} M parameters, trajectories at {}", n_params / 1e6, self._receiver.endpoint)

    # ---- wiring -------------------------------------------------------------------------
    def endpoint(self) -> str:
        """ZeroMQ address rollout actors push trajectories to."""
        return self._receiver.endpoint

    def connect_samplers(self, urls: list[str]) -> int:
        """Form the weight group with every sampler and publish version 0; returns the version."""
        self._sync.connect(urls)
        self._publish()
        return self.version

    def stop(self) -> None:
        """Ask :meth:`run` to finish after the current step (it then writes a final checkpoint)."""
        self._stop.set()

    def status(self) -> dict[str, Any]:
        """Step, version, queue depth and counters."""
        return {"step": self.step, "version": self.version, "queue_depth": self._queue.qsize(), **self.counters}

    # ---- receive thread -----------------------------------------------------------------
    def _receive_loop(self) -> None:
        """Consumes ZeroMQ frames; produces validated trajectories on the bounded queue.

        Blocks on the queue when it is full (backpressure). A frame that fails validation is
        counted, logged and written to ``quarantine/`` (first 100), never trained on.
        """
        mc = self.model_cfg
        while not self._stop.is_set():
            frame = self._receiver.recv(timeout_s=0.5)
            if frame is None:
                continue
            try:
                traj = decode(frame, num_experts=mc.num_experts, num_layers=mc.num_hidden_layers,
                              top_k=mc.num_experts_per_tok, max_version=self.version)
            except TrajectoryError as e:
                self._quarantine(frame, e)
                continue
            self.counters["received"] += 1
            if self.counters["received"] <= self.cfg.dump_trajectories:
                tdir = self.run_dir / "trajectories"
                tdir.mkdir(exist_ok=True)
                (tdir / f"{traj.trajectory_id}.msgpack").write_bytes(frame)
            while not self._stop.is_set():
                try:
                    self._queue.put(traj, timeout=0.5)
                    break
                except queue.Full:
                    continue

    def _discard(self, reason: str) -> None:
        """Give a dropped or rejected trajectory's admission slot back to the controller
        (held until :meth:`run` receives the controller)."""
        with self._discard_lock:
            self._pending_discards.append(reason)
            if self._controller is None:
                return
            pending, self._pending_discards = self._pending_discards, []
        for r in pending:
            try:
                call(self._controller.trajectory_discarded, r)
            except Exception as e:  # the controller may be gone at shutdown; never crash the learner
                logger.warning("could not tell the controller about a discarded trajectory: {}", e)

    def _quarantine(self, frame: bytes, err: Exception) -> None:
        self._discard(f"rejected: {err}")
        self.counters["rejected"] += 1
        n = self.counters["rejected"]
        logger.warning("rejected trajectory #{}: {}", n, err)
        if n <= MAX_QUARANTINED_FILES:
            qdir = self.run_dir / "quarantine"
            qdir.mkdir(exist_ok=True)
            (qdir / f"{n:06d}.msgpack").write_bytes(frame)
            (qdir / f"{n:06d}.txt").write_text(f"{err}\n")

    # ---- main loop ----------------------------------------------------------------------
    def run(self, controller: Any = None) -> dict[str, Any]:
        """Train for ``max_steps`` steps (or until :meth:`stop`), publishing and checkpointing.

        Args:
            controller: optional object (or Ray handle) with ``set_version(v)``, told after each
                publication so admission control follows the learner.

        Returns:
            Final :meth:`status`.
        """
        with self._discard_lock:
            self._controller = controller
            pending, self._pending_discards = self._pending_discards, []
        if controller is not None:
            for reason in pending:
                call(controller.trajectory_discarded, reason)
        try:
            while self.step < self.cfg.max_steps and not self._stop.is_set():
                batch = self._collect_batch()
                if batch is None:
                    break
                staleness = [self.version - t.min_version for t in batch]
                t0 = time.perf_counter()
                metrics = self._train_step(batch)
                self.step += 1
                if self.step % self.cfg.publish_every == 0:
                    self._publish()
                    if controller is not None:
                        call(controller.set_version, self.version)
                metrics.update(self._batch_metrics(batch, staleness))
                metrics["step_s"] = time.perf_counter() - t0
                metrics["tokens_per_s"] = metrics.pop("trained_tokens") / metrics["step_s"]
                self._write_metrics(metrics)
                if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        finally:
            self.save_checkpoint()
            self._stop.set()
        return self.status()

    def _collect_batch(self) -> list[Trajectory] | None:
        """Take ``batch_size`` trajectories within the staleness bound; drop and count older ones."""
        batch: list[Trajectory] = []
        deadline = time.monotonic() + self.cfg.batch_timeout_s
        while len(batch) < self.cfg.batch_size:
            if self._stop.is_set():
                return None
            if time.monotonic() > deadline:
                logger.error("learner starved: {} of {} trajectories in {} s; stopping", len(batch),
                             self.cfg.batch_size, self.cfg.batch_timeout_s)
                return None
            try:
                traj = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            staleness = self.version - traj.min_version
            if staleness > self.cfg.max_staleness:
                self.counters["dropped_stale"] += 1
                self._discard(f"stale: {staleness} > {self.cfg.max_staleness}")
                logger.warning("dropped trajectory {} of {}: staleness {} > {}", traj.trajectory_id, traj.task,
                               staleness, self.cfg.max_staleness)
                continue
            batch.append(traj)
        return batch

    def _train_step(self, batch: list[Trajectory]) -> dict[str, float]:
        """One actor-critic update on ``batch`` (micro-batches of one trajectory, accumulated)."""
        cfg = self.cfg
        items = []
        for traj in batch:
            ids = torch.from_numpy(traj.token_ids.astype(np.int64))
            inp, tgt = ids[:-1].unsqueeze(0), ids[1:].unsqueeze(0)
            mask = torch.from_numpy(traj.loss_mask[1:].astype(np.float32)).unsqueeze(0)
            mu = torch.from_numpy(traj.logprobs[1:].astype(np.float32)).unsqueeze(0)
            replay = torch.from_numpy(traj.routed_experts.astype(np.int64)).unsqueeze(0) if cfg.routing_replay else None
            with torch.no_grad():
                old_v = self.critic(inp)
            idx = mask[0].nonzero().squeeze(-1)
            rewards = np.zeros(idx.numel(), dtype=np.float32)
            rewards[-1] = traj.reward
            adv_s, ret_s = gae(rewards, old_v[0, idx].numpy(), cfg.gamma, cfg.lam)
            adv, ret = torch.zeros_like(mask), torch.zeros_like(mask)
            adv[0, idx], ret[0, idx] = torch.from_numpy(adv_s), torch.from_numpy(ret_s)
            items.append({"inp": inp, "tgt": tgt, "mask": mask, "mu": mu, "replay": replay, "old_v": old_v, "adv": adv, "ret": ret})
        n_tokens = float(sum(it["mask"].sum() for it in items))
        if cfg.normalize_advantages:
            flat = torch.cat([it["adv"][it["mask"].bool()] for it in items])
            mean, std = flat.mean(), flat.std(unbiased=False).clamp(min=1e-6)
            for it in items:
                it["adv"] = (it["adv"] - mean) / std * it["mask"]
        train_policy = self.step >= cfg.critic_warmup_steps
        sums = {"policy_loss": 0.0, "value_loss": 0.0, "clip_frac": 0.0, "is_weight_mean": 0.0, "is_truncated_frac": 0.0}
        diff_sum, is_max = 0.0, 0.0
        for epoch in range(cfg.ppo_epochs):
            self.policy_opt.zero_grad(set_to_none=True)
            self.critic_opt.zero_grad(set_to_none=True)
            for it in items:
                with torch.set_grad_enabled(train_policy):
                    out = self.policy(it["inp"], routed_experts=it["replay"])
                    logp = token_logprobs(out.logits, it["tgt"])
                if epoch == 0:
                    it["prox"] = logp.detach()  # proximal policy = the weights before this update
                    diff_sum += float(((it["prox"] - it["mu"]).abs() * it["mask"]).sum())
                pl = policy_loss(logp, it["prox"], it["mu"], it["adv"], it["mask"], clip_eps=cfg.clip_eps,
                                 is_cap=cfg.is_cap, denom=n_tokens)
                vl = value_loss(self.critic(it["inp"]), it["old_v"], it["ret"], it["mask"], clip=cfg.value_clip, denom=n_tokens)
                loss = cfg.value_coef * vl + (pl.loss if train_policy else 0.0)
                loss.backward()
                if epoch == cfg.ppo_epochs - 1:
                    w = float(it["mask"].sum()) / n_tokens
                    sums["policy_loss"] += float(pl.loss.detach())
                    sums["value_loss"] += float(vl.detach())
                    for k in ("clip_frac", "is_weight_mean", "is_truncated_frac"):
                        sums[k] += getattr(pl, k) * w
                    is_max = max(is_max, pl.is_weight_max)
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
            self.critic_opt.step()
            if train_policy:
                gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
                sums["grad_norm"] = float(gn)
                self.policy_opt.step()
        return {**sums, "is_weight_max": is_max, "logprob_diff_mean": diff_sum / max(n_tokens, 1.0),
                "train_policy": train_policy, "trained_tokens": n_tokens}

    def _batch_metrics(self, batch: list[Trajectory], stale: list[int]) -> dict[str, Any]:
        self.counters["trained"] += len(batch)
        return {
            "step": self.step,
            "version": self.version,
            "trajectories": len(batch),
            "trajectories_total": self.counters["trained"],
            "dropped_stale": self.counters["dropped_stale"],
            "rejected": self.counters["rejected"],
            "reward_mean": float(np.mean([t.reward for t in batch])),
            "resolved_rate": float(np.mean([t.resolved for t in batch])),
            "staleness_max": int(max(stale)) if stale else 0,
            "staleness_mean": float(np.mean(stale)) if stale else 0.0,
            "versions_in_batch": sorted({int(v) for t in batch for v in np.unique(t.versions[t.loss_mask.astype(bool)])}),
            "tokens": int(sum(t.num_tokens for t in batch)),
            "turns_mean": float(np.mean([t.turn_offsets.shape[0] for t in batch])),
            "queue_depth": self._queue.qsize(),
        }

    def _publish(self) -> None:
        """Broadcast the policy to every sampler as the next version (version 0 at start)."""
        if self.step > 0:
            self.version += 1
        t0 = time.perf_counter()
        self._sync.publish(self.policy.named_parameters(), self.version)
        logger.info("published weight version {} in {:.2f} s", self.version, time.perf_counter() - t0)

    def _write_metrics(self, metrics: dict[str, Any]) -> None:
        with self._metrics_path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        logger.info("step {step} v{version}: reward {reward_mean:.2f} resolved {resolved_rate:.2f} "
                    "staleness max {staleness_max} |dlogp| {logprob_diff_mean:.4f} {tokens_per_s:.0f} tok/s", **metrics)

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_NNNNNN/`` (policy safetensors + config.json, critic, state)."""
        path = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        path.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(path)
        save_file({k: v.detach().contiguous() for k, v in self.critic.state_dict().items()}, str(path / "critic.safetensors"))
        (path / "trainer_state.json").write_text(json.dumps({"step": self.step, "version": self.version, **self.counters}))
        logger.info("checkpoint written to {}", path)
        return path

    def close(self) -> None:
        """Stop the receive thread and close the socket."""
        self._stop.set()
        self._recv_thread.join(timeout=2)
        self._receiver.close()
        self._sync.close()

