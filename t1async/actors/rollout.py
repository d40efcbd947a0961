"""Rollout role: episodes one after another against a sampler, trajectories streamed to the learner.

The episode itself is :func:`t1async.rollout.episode.run_episode` (or, for an episode whose agent, drawn
from ``rollout.agent`` by :class:`t1async.rollout.agent_mix.AgentMix`, is not builtin,
:func:`t1async.rollout.endpoint.agent.run_agent_episode`); this role wires it to Ray: it
waits for admission from the controller before each episode (staleness control), runs the episode
in a fresh sandbox (``t1async.envs``), encodes the trajectory and hands it to its ZeroMQ sender
(it spools, sends and resends until the learner acknowledges; t1async/transport/transport.py),
and stops when admission says so.

A full or failing disk (its workspace or spool refuses writes: ENOSPC, EIO) is not a reason to
spin: an episode that fails on it, or a trajectory its spool cannot take, makes the actor back off
(1, 2, 4 ... :data:`DISK_BACKOFF_MAX_S` s, reset by the next episode that works); a trajectory
already finished is kept in memory and spooled once space is back, never dropped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from loguru import logger

import t1async.envs
from t1async.actors import call
from t1async.config import EnvConfig, GenerationConfig, ModelConfig, RolloutConfig, TransportConfig
from t1async.envs.sandboxes.container import remove_orphan_containers
from t1async.envs.sandboxes.limits import unmount_all_under
from t1async.envs.taskio.loading import discover_tasks
from t1async.envs.terminal import TerminalEnv
from t1async.fileio import claim_folder, dead_owner_folders, free_bytes, is_disk_error
from t1async.models.families import load_renderer
from t1async.rollout.agent_mix import AgentMix
from t1async.rollout.episode import run_episode
from t1async.rollout.harnesses import HARNESSES, check_sandbox
from t1async.sampling.sampler_client import HttpSampler, RoutedSampler
from t1async.trajectory import EncodedTrajectory, Trajectory
from t1async.transport.transport import TrajectorySender, ZmqSender

DISK_BACKOFF_MAX_S = 60.0  # longest pause between tries on a full disk
DISK_LOW_BYTES = 16 << 20  # an episode failing with less free than this in its workspace counts as a disk fault


class RolloutActor:
    """One rollout actor: episodes one after another, trajectories pushed over ZeroMQ.

    Args:
        actor_id: this actor's number (also picks its sampler: ``sampler_urls[actor_id % M]``).
        env_cfg, gen_cfg, model_cfg, transport: config sections.
        sampler_urls: base URLs of the samplers at start; the live list comes from the controller's
            ``sampler_urls()`` when it has one (:class:`~t1async.sampling.sampler_client.RoutedSampler`: asked
            per episode; a request a sampler cannot take goes to another).
        endpoint: the learner's ZeroMQ address.
        crash_after_episodes: fault injection for tests (0 = off).
        request_timeout_s: HTTP timeout of one /generate call, seconds.
        work_root: folder for this actor's episode workspaces (launch uses ``RUN_DIR/workspaces``
            and removes it at shutdown, also when the actor was killed); None: the system temp dir.
        audit_dir: when set, the id of each trajectory is appended to ``audit_dir/sent-<pid>.txt``
            once it is spooled (``t1async soak`` counts from it what was sent); None: no record.
        rollout_cfg: the ``rollout`` section; an episode whose agent (``rollout.agent``, one name or a
            weighted mix drawn per episode) is not builtin is driven through this actor's agent endpoint
            (t1async/rollout/endpoint/agent.py). None: the builtin loop.
        seed: ``run.seed``: with the actor's number, it seeds the draw of each episode's agent.
    """

    def __init__(self, actor_id: int, env_cfg: EnvConfig, gen_cfg: GenerationConfig, model_cfg: ModelConfig,
                 transport: TransportConfig, sampler_urls: list[str], endpoint: str, *, crash_after_episodes: int = 0,
                 request_timeout_s: float = 300.0, work_root: str | None = None, audit_dir: str | None = None,
                 rollout_cfg: RolloutConfig | None = None, seed: int = 0):
        self.actor_id = actor_id
        self.env_cfg, self.gen_cfg, self.model_cfg = env_cfg, gen_cfg, model_cfg
        self.tasks = {t.name: t for t in discover_tasks(tasks_dir(env_cfg), env_cfg.tasks, sandbox=env_cfg.sandbox)}
        self.tokenizer = load_renderer(model_cfg)  # model.path's own chat template, or the shipped ChatML
        self.sampler = RoutedSampler(sampler_urls, actor_id, lambda url: HttpSampler(
            url, num_layers=model_cfg.routed_layers, top_k=model_cfg.num_experts_per_tok,
            num_experts=model_cfg.num_experts, timeout_s=request_timeout_s), unavailable_for_s=request_timeout_s)
        self.sender: TrajectorySender = ZmqSender.from_config(endpoint, transport)
        self.crash_after = crash_after_episodes
        self.episodes = 0
        self.failed = 0
        self._rejections_reported = 0
        self._disk_backoff_s = 0.0  # the current back-off on a full disk (0: none)
        self.workdir, self._workdir_lock = claim_workdir(work_root, actor_id)
        self.rollout_cfg = rollout_cfg or RolloutConfig()
        self.agents = AgentMix(self.rollout_cfg.agent, seed, actor_id)
        self.endpoint = None
        if set(self.agents.names) != {"builtin"}:  # external or a named harness (checked installed here)
            # (fastapi: imported only by the external-agent endpoint, not by the builtin loop)
            from t1async.rollout.endpoint import OpenAIEndpoint

            for name in self.agents.names:
                if name in HARNESSES:
                    check_sandbox(name, env_cfg.sandbox)  # one line: not installed (its install), or not in that sandbox

            self.endpoint = OpenAIEndpoint(self.tokenizer)
        self._audit = None
        if audit_dir:
            Path(audit_dir).mkdir(parents=True, exist_ok=True)
            self._audit = open(Path(audit_dir) / f"sent-{os.getpid()}.txt", "a", buffering=1)  # noqa: SIM115

    def run(self, controller: Any) -> dict[str, int]:
        """Loop: admission -> episode -> send, until the controller answers None.

        Consumes admissions from ``controller.acquire(actor_id)`` (a task name, ``""`` = wait and
        ask again, None = stop); produces one ZeroMQ frame per finished episode. An episode that
        fails (sampler or sandbox error) is logged, counted and reported with
        ``controller.episode_failed`` (with the agent drawn for it), and each trajectory the learner rejects (REJ) with
        ``controller.trajectory_discarded``, so that its admission slot is returned. A finished
        episode's trajectory id is told to ``controller.episode_finished`` before it is sent.
        """
        if hasattr(controller, "sampler_urls"):  # live routing (samplers scaled, restarted)
            self.sampler.routes = lambda: call(controller.sampler_urls)
        try:
            while True:
                self._report_rejections(controller)
                name = call(controller.acquire, self.actor_id)
                if name is None:
                    break
                if name == "":
                    continue
                agent = self.agents.draw()
                try:
                    trajs = self.run_one(name, agent)
                except Exception as e:  # one bad episode must not end the actor
                    self.failed += 1
                    logger.opt(exception=e).error("rollout {} episode of {} ({}) failed", self.actor_id, name, agent)
                    call(controller.episode_failed, self.actor_id, f"{type(e).__name__}: {e}", agent)
                    if self._disk_fault(e):
                        self._back_off(f"episode of {name} failed on the disk")
                    continue
                self._disk_backoff_s = 0.0
                traj = trajs[-1]  # the episode's last segment; earlier ones take slots of their own
                extra = [[t.trajectory_id for t in trajs[:-1]]] if len(trajs) > 1 else []
                call(controller.episode_finished, self.actor_id, traj.trajectory_id, *extra)  # before they can be consumed
                for t in trajs:
                    self._send(t)
                    if self._audit is not None:
                        self._audit.write(t.trajectory_id + "\n")
                self.episodes += 1
                logger.info("rollout {} sent {} ({}): {} tokens, {} turns, {}/{} tests, versions {}, {:.2f} s",
                            self.actor_id, name, traj.agent, traj.num_tokens, len(traj.turn_offsets), traj.passed, traj.total,
                            sorted(set(traj.versions[traj.loss_mask.astype(bool)].tolist())),
                            traj.finished_at - traj.started_at)
                if self.crash_after and self.episodes >= self.crash_after:
                    raise RuntimeError(f"fault injection: rollout {self.actor_id} crashes after {self.episodes} episodes")
        finally:
            self.sender.close()
            if self.endpoint is not None:
                self.endpoint.shutdown()
            unmount_all_under(self.workdir)  # sandboxes unmount their own; this catches one that could not
            shutil.rmtree(self.workdir, ignore_errors=True)
            try:
                self._report_rejections(controller)  # REJs that came during the final flush
            except Exception as e:  # the controller may be gone at shutdown
                logger.warning("rollout {} could not report rejected trajectories: {}", self.actor_id, e)
        return {"episodes": self.episodes, "failed": self.failed, "rerouted": self.sampler.rerouted}

    def _disk_fault(self, e: BaseException) -> bool:
        """Whether ``e`` is the disk's fault (t1async/fileio.py ``is_disk_error``, or the workspace's
        filesystem has less than :data:`DISK_LOW_BYTES` free: a sandbox's own error text may not say why)."""
        try:
            return is_disk_error(e) or free_bytes(self.workdir) < DISK_LOW_BYTES
        except OSError:
            return True

    def _back_off(self, why: str) -> None:
        """Sleep 1, 2, 4 ... :data:`DISK_BACKOFF_MAX_S` s (doubling per call, reset by a working episode)."""
        self._disk_backoff_s = min(DISK_BACKOFF_MAX_S, max(1.0, 2 * self._disk_backoff_s))
        logger.error("rollout {}: {}; waiting {:.0f} s for disk space", self.actor_id, why, self._disk_backoff_s)
        time.sleep(self._disk_backoff_s)

    def _send(self, traj: Trajectory) -> None:
        """Spool and queue ``traj`` (the sender delivers it); while the disk refuses the spool
        file, back off and try again: a finished trajectory is never dropped for a full disk."""
        frame = EncodedTrajectory(traj)
        while True:
            try:
                self.sender.send(traj.trajectory_id, frame)
                return
            except OSError as e:
                if not self._disk_fault(e):
                    raise
                self._back_off(f"trajectory {traj.trajectory_id} could not be spooled ({e})")

    def _report_rejections(self, controller: Any) -> None:
        """Return the admission slot of each trajectory the learner rejected since the last call."""
        reasons = self.sender.stats.rejections[self._rejections_reported:]
        keys = self.sender.stats.rejected_keys[self._rejections_reported:]
        for reason, key in zip(reasons, keys):
            call(controller.trajectory_discarded, f"rejected: {reason}", key)
        self._rejections_reported += len(reasons)

    def run_one(self, task_name: str, agent: str | None = None) -> list[Trajectory]:
        """Run one episode of the named task in a fresh sandbox, driven by ``agent`` (None: the next
        draw of ``rollout.agent``), and return its trajectories (one, or one per exact segment of an
        external agent that broke its history), each recording its agent."""
        if task_name not in self.tasks:  # the task set was changed live (t1async scale env.tasks=...)
            self.tasks.update({t.name: t for t in discover_tasks(tasks_dir(self.env_cfg), [task_name],
                                                                 sandbox=self.env_cfg.sandbox)})
        task = self.tasks[task_name]
        agent = self.agents.draw() if agent is None else agent
        self.sampler.begin_episode()
        env = TerminalEnv.from_config(task, self.workdir, self.env_cfg)
        try:
            if agent != "builtin":
                from t1async.rollout.endpoint.agent import run_agent_episode  # (fastapi, as OpenAIEndpoint above)

                return run_agent_episode(task, env, self.sampler, self.tokenizer, self.endpoint, self.rollout_cfg,
                                         self.env_cfg, self.gen_cfg, self.model_cfg, self.actor_id,
                                         self.workdir / "agent-logs", agent=agent)
            return [run_episode(task, env, self.sampler, self.tokenizer, self.env_cfg, self.gen_cfg, self.model_cfg,
                                self.actor_id)]
        finally:
            env.close()


def claim_workdir(work_root: str | Path | None, actor_id: int) -> tuple[Path, int]:
    """A new workspace folder ``t1async-rollout<id>-*`` under ``work_root`` (None: the system temp
    dir), owned by this process (:func:`t1async.fileio.claim_folder`); returns (folder, the lock's
    file descriptor). First reclaims the folders of dead actors there (:func:`reclaim_dead_workdirs`).
    """
    root = Path(work_root) if work_root else Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    reclaim_dead_workdirs(root)
    return claim_folder(root, f"t1async-rollout{actor_id}-")


def reclaim_dead_workdirs(root: Path) -> int:
    """Unmount and remove every ``t1async-rollout*`` folder under ``root`` whose owner died (its
    lock is free): an actor killed with SIGKILL leaves its sandboxes' tmpfs mounts, files and
    running containers behind. Returns how many folders were reclaimed; live actors' folders are left alone."""
    reclaimed = 0
    for folder in dead_owner_folders(root, "t1async-rollout*"):
        remove_orphan_containers(folder)  # a killed actor's containers keep running: their owner is dead
        mounts = unmount_all_under(folder)
        shutil.rmtree(folder, ignore_errors=True)
        reclaimed += 1
        logger.warning("reclaimed the workspace of a dead rollout actor: {} ({} mounts detached)", folder, mounts)
    return reclaimed


def tasks_dir(env_cfg: EnvConfig) -> Path:
    """The configured task folder, or the shipped ``t1async/envs/tasks``."""
    if env_cfg.tasks_dir:
        return Path(env_cfg.tasks_dir)
    return Path(t1async.envs.__file__).parent / "tasks"
