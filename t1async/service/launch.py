"""``t1async launch``: the table of contents of the whole system.

    pre-flight (t1async/service/preflight.py: config + the run's live-change history on a resume,
           a resume's run directory, init checkpoint, tokenizer, tasks, sandbox, port, keys) -> run directory
           (locked, never mixed with an earlier run) -> reaper -> Ray -> counts within the cluster's
           capacity (t1async/service/capacity.py)
           -> samplers (HTTP, SGLang protocol) and, started alongside them, the learner (ZeroMQ ROUTER;
              it joins the samplers' weight group once they serve: version 0)
           -> controller (admission, supervision, sampler routing) -> rollout actors (episodes -> ZeroMQ
              DEALER, ACKed) -> sampler pool (live sampler count, sampler restarts)
           -> service: control socket (status/stop/scale), learner restarts, status line, TensorBoard;
              until max_steps (0: until stopped), t1async stop, or a signal -> stop everything -> summary

The roles are plain classes in ``t1async.actors`` and get ``ray.remote`` here; the run loops
themselves start in the controller (rollout actors) and in :class:`t1async.service.service.Service`
(supervision), which this function hands over to.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

import ray
from loguru import logger
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from t1async.actors import error_line
from t1async.actors.controller import Controller
from t1async.actors.learner import Learner
from t1async.actors.rollout import RolloutActor
from t1async.actors.sampler import EmbeddedSampler
from t1async.config import Config, ConfigError, RayConfig, RunConfig, to_yaml
from t1async.envs.sandboxes.container import remove_orphan_containers
from t1async.envs.sandboxes.limits import unmount_all_under
from t1async.fileio import replace_file
from t1async.learner.checkpoints import newest_intact_checkpoint
from t1async.rollout.task_order import read_task_order
from t1async.sampling.sglang_server import start_servers, stop_servers
from t1async.service.capacity import Capacity, clamp_counts, cluster_capacity
from t1async.service.control import ControlServer
from t1async.service.preflight import check_tasks, preflight
from t1async.service.reaper import Reaper, kill_sandboxes_under
from t1async.service.rundir import RunDirLock, check_reuse
from t1async.service.sampler_pool import SamplerPool
from t1async.service.service import LearnerDied, Service
from t1async.transport.keys import run_keys_dir

ACTOR_MAX_CONCURRENCY = 64  # threads of the controller/learner/sampler actors (acquire() waits block one each)
PLACEMENT_SHARE = 0.001  # of its node's custom resource each placed actor asks for: a mark, not a capacity
ROLE_OF = {"Learner": "learner", "Controller": "controller", "EmbeddedSampler": "sampler", "RolloutActor": "rollout"}
"""The ``ray.placement`` role of each actor class launch starts."""


def launch(config_path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the asynchronous RL service described by ``config_path`` and ``overrides`` until it ends.

    Returns:
        The run summary (also written to ``RUN_DIR/summary.json``); ``ended`` says how it ended
        (``done``, ``stopped``, ``signal``, ``learner_died``, ``learner_failed_to_start``) and
        ``error`` holds one line when the learner died for good or could not start.

    Raises:
        ConfigError, TaskError, SandboxUnavailable, KeysError: bad input, before anything is started
            (a run directory in use or holding an earlier run included).
    """
    cfg, run_dir, task_names = preflight(config_path, overrides)  # every bad-input error, before any process starts
    cfg.rollout.agent_cwd = cfg.rollout.agent_cwd or os.getcwd()  # an external agent's relative paths
    lock = claim_run_dir(cfg, run_dir)
    if cfg.env.sandbox == "container":  # an earlier launch killed before its reaper could remove them
        remove_orphan_containers(run_dir / "workspaces", cfg.env.container)
    cfg.transport.spool_dir = cfg.transport.spool_dir or str(run_dir / "spool")  # resent by a resumed run
    if cfg.transport.curve and not cfg.transport.keys_dir:  # authenticated by default: keys for this host
        cfg.transport.keys_dir = str(run_keys_dir(run_dir))
    logger.info("run directory: {}", run_dir)
    logger.info("{} tasks, {} rollout actors, {} sampler(s), {} learner steps", len(task_names), cfg.rollout.num_actors,
                cfg.sampler.num_samplers, cfg.learner.max_steps or "unlimited (until t1async stop)")
    t_start = time.time()
    reaper = Reaper.start(run_dir)  # cleans up Ray and the sandboxes should this process be killed
    try:
        ctx = init_ray(cfg)
    except RayStartFailed as e:  # nothing started: no summary.json, one line and exit status 1
        reaper.done()
        lock.release()
        return {"run_dir": str(run_dir), "max_steps": cfg.learner.max_steps, "error": str(e),
                "ended": "ray_failed_to_start"}
    ray_session = ctx.address_info.get("session_dir")
    ray_local = cfg.ray.address in (None, "", "local")  # a Ray this launch starts (and stops)
    lock.write(ray_session=ray_session, ray_local=ray_local)  # (the reaper removes a local one too)
    capacity = fit_to_cluster(cfg)  # rollout actors and samplers within what the cluster holds (a resume's too)
    actor = _actor_factory(run_dir, cfg.run, cfg.ray)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "max_steps": cfg.learner.max_steps}
    roles: dict[str, Any] = {}
    control = pool = None
    try:
        try:  # the learner starts alongside the samplers and publishes weight version 0 once they serve
            roles["learner"], endpoint, urls = start_samplers_and_learner(cfg, actor, run_dir, roles)
        except LearnerStartFailed as e:
            summary["error"], summary["ended"] = str(e), "learner_failed_to_start"
            return summary
        lock.write(trajectories=endpoint)  # the learner's trajectory socket, for a person or a tool to find
        resumed = announce_resume(cfg, roles["learner"], run_dir)  # admission continues from it (not from 0)
        roles["controller"], roles["controller_run"] = start_controller(  # starts the rollout actors
            cfg, actor, task_names, urls, endpoint, task_order=saved_task_order(resumed and resumed["checkpoint"]),
            resumed=resumed)
        pool = sampler_pool(cfg, actor, roles, urls)  # live scaling and restarts of embedded samplers
        service = Service(cfg, run_dir, roles,
                          lambda: restart_learner(service.cfg, actor, run_dir, pool.member_urls() if pool else urls,
                                                  endpoint),
                          lambda names: check_tasks(service.cfg, names), samplers=pool, capacity=capacity,
                          restart_controller=lambda learner: restart_controller(
                              service.cfg, actor, task_names, pool.serving_urls() if pool else urls, endpoint, learner))
        control = ControlServer(cfg.transport.host, service.handlers())
        lock.write(control=control.address)
        logger.info("control: t1async status|stop|scale {}", run_dir)
        try:
            summary["learner"], summary["ended"] = service.run()
        except LearnerDied as e:
            summary["error"], summary["ended"] = str(e), "learner_died"
        summary["max_steps"], summary["stop_request"] = service.cfg.learner.max_steps, service.stop_request
        summary["restarts"] = service.restart_counts()  # learner and samplers
    finally:
        if control is not None:
            control.close()
        if pool is not None:
            pool.close()
            roles["samplers"] = pool.handles()
        # t1async stop --now: running episodes are abandoned (nothing finished is lost: spools keep it);
        # t1async stop: they get 30 s to finish and spool; otherwise 5 s
        grace = {"now": 0.0, "drain": 30.0}.get(summary.get("stop_request") or "", 5.0)
        summary.update(shutdown(roles, grace_s=grace))
        if roles.get("sglang_servers"):
            stop_servers(roles["sglang_servers"])
        kill_sandboxes_under(run_dir / "workspaces")  # a sandbox can outlive its killed rollout actor
        if cfg.env.sandbox == "container":
            remove_orphan_containers(run_dir / "workspaces", cfg.env.container)
        unmount_all_under(run_dir / "workspaces")  # killed actors cannot clean up themselves
        shutil.rmtree(run_dir / "workspaces", ignore_errors=True)
        summary["wall_s"] = round(time.time() - t_start, 1)
        summary.update(_metrics_summary(run_dir / "metrics.jsonl"))
        try:
            replace_file(run_dir / "summary.json", json.dumps(summary, indent=2, default=str))  # (never a torn file)
        except OSError as e:  # a full disk: the summary is still logged below
            logger.error("summary.json not written ({}); the summary follows in the log", e)
        ray.shutdown()
        if ray_local:  # a Ray this launch started: its session folder goes, its logs are kept
            keep_ray_logs(ray_session, run_dir)
        reaper.done()
        lock.release()
    logger.info("done: {}", json.dumps({k: v for k, v in summary.items() if k not in ("samplers",)}, default=str))
    return summary


def claim_run_dir(cfg: Config, run_dir: Path) -> RunDirLock:
    """Own ``run_dir`` (:class:`~t1async.service.rundir.RunDirLock`), refuse to mix it with an earlier run
    (unless ``learner.resume`` or ``run.overwrite``), clean up after a holder that was killed,
    save the resolved config, and log there (``logs/t1async.log``).

    Raises:
        ConfigError: the directory is in use, holds an earlier run, or cannot be created.
    """
    lock = RunDirLock(run_dir)
    try:
        check_reuse(run_dir, resume=cfg.learner.resume, overwrite=cfg.run.overwrite)
    except ConfigError:
        lock.release()
        raise
    lock.write()
    cfg.run.dir = str(run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    add_log_sink(run_dir, "t1async", cfg.run, keep_stderr=True)
    if lock.previous is not None:
        logger.warning("took over {} from a launch that did not exit cleanly (pid {}); cleaning up what it left",
                       run_dir, lock.previous.get("pid"))
    if (run_dir / "workspaces").exists():
        unmount_all_under(run_dir / "workspaces")
        shutil.rmtree(run_dir / "workspaces", ignore_errors=True)
    return lock


RAY_START_ATTEMPTS = 3
"""Tries at starting a local Ray node: on a loaded machine Ray's own start-up wait can expire
("The current node timed out during startup"), which a second try usually survives."""


def init_ray(cfg: Config, attempts: int = RAY_START_ATTEMPTS) -> Any:
    """``ray.init`` for this launch (``ray.address``, ``ray.num_cpus``, no dashboard, workers' logs
    kept in their files), tried again up to ``attempts`` times in all when Ray says its node timed
    out during start-up; any other error, or the last try's, is raised as Ray raised it.

    Returns:
        Ray's context (``address_info`` holds the session folder).
    """
    for attempt in range(1, attempts + 1):
        try:
            return ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=False,
                            log_to_driver=False, logging_level="WARNING")
        except Exception as e:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(e):
                raise
            ray.shutdown()
            if attempt == attempts:
                load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
                raise RayStartFailed(
                    f"Ray's node did not start in {attempts} tries (Ray: the node timed out during start-up); "
                    f"the machine's load average is {load:.0f} on {os.cpu_count()} CPUs: launch again when the "
                    f"load is lower, or start Ray yourself (ray start --head) and set ray.address") from None
            logger.warning("Ray's node timed out during start-up (try {} of {}); starting it again", attempt, attempts)
    raise AssertionError("unreachable")


class RayStartFailed(RuntimeError):
    """A local Ray node did not start in :data:`RAY_START_ATTEMPTS` tries; one line with the
    machine's load, and what to do."""


def fit_to_cluster(cfg: Config) -> Capacity:
    """The Ray cluster's capacity (t1async/service/capacity.py); lowers ``rollout.num_actors`` and
    (embedded) ``sampler.num_samplers`` in ``cfg`` to what it can hold, saying so in one line each.
    A resume gets here with its live changes applied, so a count scaled past the bound (with
    ``--force``) or recorded before the bound existed does not flood the node again."""
    cap = cluster_capacity(cfg.ray, ray.cluster_resources())
    embedded = cfg.sampler.backend == "embedded"
    actors, samplers, notes = clamp_counts(cap, cfg.rollout.num_actors, cfg.sampler.num_samplers if embedded else 0)
    for note in notes:
        logger.warning("{}", note)
    cfg.rollout.num_actors = actors
    if embedded:
        cfg.sampler.num_samplers = samplers
    return cap


def announce_resume(cfg: Config, learner: Any, run_dir: Path) -> dict[str, Any] | None:
    """Say on the console what a resume restored, or warn that there was nothing to resume.

    Returns:
        None (not a resume, or nothing to resume), or the learner's ``resumed`` status
        (``checkpoint``: the folder it resumed from or None, ``step``, ``timeline_version``,
        ``to_replay``...) with ``trained``, the trajectories it trained before: where the
        controller's admission continues from (:func:`t1async.rollout.admission.resumed_admissions`).
    """
    if not cfg.learner.resume:
        return None
    st = ray.get(learner.status.remote())
    r = st["resumed"]
    for line in r.get("set_aside", []):  # newer checkpoints that failed verification
        logger.warning("{}", line)
    if r["checkpoint"] is None and r["to_replay"] == 0:
        logger.warning("learner.resume=true but {} holds nothing to resume (no checkpoint, empty receive log): "
                       "starting fresh at step 0", run_dir)
        return None
    logger.info("resumed from {}: step {}, version {}, {} trajectory ids consumed, {} receive-log records to replay",
                Path(r["checkpoint"]).name if r["checkpoint"] else "no checkpoint (receive log only)", r["step"],
                r["version"], r["consumed"], r["to_replay"])
    return {**r, "trained": st.get("trained", 0)}


def saved_task_order(checkpoint: str | None) -> dict[str, Any] | None:
    """The task order saved in the checkpoint a resumed learner restored, for its controller to
    continue (t1async/rollout/task_order.py); None, said on the console, when it holds none or
    it is unreadable (the order then starts over from its head)."""
    if checkpoint is None:
        return None
    try:
        state = read_task_order(checkpoint)
    except ValueError as e:
        logger.error("{}", e)
        return None
    if state is None:
        logger.warning("{} holds no task order (written before it was saved): the task order starts over from "
                       "its head", Path(checkpoint).name)
    return state


def start_samplers_and_learner(cfg: Config, actor: Any, run_dir: Path, roles: dict[str, Any]) -> tuple[Any, str, list[str]]:
    """The samplers and the learner, started side by side: embedded samplers and the learner actor
    are created together (the learner builds its models while the samplers build theirs), then the
    learner joins the samplers' weight group once they serve (:func:`join_learner`: weight version
    0). SGLang servers (``sampler.backend=sglang``, processes) are started first, as before, the
    learner after them. Fills ``roles`` with the samplers once they serve (``samplers``;
    ``sglang_servers`` too for SGLang), so that launch's shutdown stops them should the learner fail.

    Returns:
        The learner's handle, its ZeroMQ endpoint, the samplers' URLs.

    Raises:
        LearnerStartFailed: as :func:`start_learner`.
    """
    if cfg.sampler.backend == "sglang":  # processes, not Ray actors: launch stops them
        roles["sglang_servers"], urls = start_samplers(cfg, actor, run_dir)
        roles["samplers"] = []
        learner, endpoint = start_learner(cfg, actor, run_dir, urls)
        return learner, endpoint, urls
    samplers = [start_sampler(cfg, actor, i) for i in range(cfg.sampler.num_samplers)]
    learner = create_learner(cfg, actor, run_dir)  # not waited for: it starts while the samplers do
    logger.info("learner started alongside {} sampler(s)", len(samplers))
    try:
        urls = ray.get([s.url.remote() for s in samplers])
    except BaseException:
        _try(lambda: ray.kill(learner))  # (a sampler failed to start: launch raises Ray's error, as before)
        raise
    roles["samplers"] = samplers
    logger.info("samplers serving: {}", ", ".join(urls))
    return learner, join_learner(learner, urls, run_dir), urls


def start_samplers(cfg: Config, actor: Any, run_dir: Path | None = None) -> tuple[list[Any], list[str]]:
    """M samplers (no weights until the learner publishes) and their URLs: embedded engines in Ray
    actors, or for ``sampler.backend=sglang`` SGLang servers (t1async/sampling/sglang_server.py: started
    here, returned as processes, or attached to ``sampler.urls``)."""
    if cfg.sampler.backend == "sglang":
        run_dir = run_dir or Path(cfg.run.dir)
        return start_servers(cfg.sampler, run_dir, sglang_model_dir(cfg, run_dir))

    samplers = [start_sampler(cfg, actor, i) for i in range(cfg.sampler.num_samplers)]
    return samplers, ray.get([s.url.remote() for s in samplers])


def sglang_model_dir(cfg: Config, run_dir: Path) -> str:
    """The folder SGLang servers start from and are checked against: with ``model.path``, on
    ``learner.resume`` the newest checkpoint ``run_dir/checkpoints/step_N`` that verifies
    (t1async/learner/checkpoints.py ``newest_intact_checkpoint``; an HF folder; one that does not verify is
    skipped here and moved aside by the learner) and has config.json, else ``model.path``. Without
    ``model.path``: empty (``sampler.model_path`` as given, no check)."""
    if not cfg.model.path:
        return ""
    step = newest_intact_checkpoint(run_dir / "checkpoints") if cfg.learner.resume else None
    if step is not None and (step / "config.json").is_file():
        logger.info("SGLang servers start from the resumed checkpoint {}", step)
        return str(step)
    return cfg.model.path


def start_sampler(cfg: Config, actor: Any, index: int) -> Any:
    """Embedded sampler ``index`` (a Ray actor, no weights yet; logs to ``logs/sampler<index>.log``)."""
    return actor(EmbeddedSampler, f"sampler{index}").remote(cfg.model, cfg.sampler, seed=cfg.run.seed + index,
                                                            torch_threads=cfg.run.torch_threads)


def sampler_pool(cfg: Config, actor: Any, roles: dict[str, Any], urls: list[str]) -> SamplerPool | None:
    """The embedded samplers' pool (t1async/service/sampler_pool.py), holding the ones launch started;
    None for SGLang servers (not scaled or restarted live)."""
    if cfg.sampler.backend != "embedded":
        return None
    pool = SamplerPool(lambda i: start_sampler(cfg, actor, i), lambda: roles["learner"], roles["controller"],
                       restarts=cfg.run.sampler_restarts)
    pool.adopt(roles["samplers"], urls)
    return pool


class LearnerStartFailed(RuntimeError):
    """The learner actor could not start (its ``__init__`` or its joining the samplers raised, or
    it died meanwhile); the message is one line naming the cause and the log with the traceback."""


def start_learner(cfg: Config, actor: Any, run_dir: Path, urls: list[str]) -> tuple[Any, str]:
    """The learner, joined to every sampler's weight group with version 0 published; its ZeroMQ endpoint.

    Raises:
        LearnerStartFailed: any failure of the actor meanwhile, in one line (:func:`error_line`;
            the traceback is in ``RUN_DIR/logs/learner.log``), never Ray's multi-line error.
    """
    learner = create_learner(cfg, actor, run_dir)
    return learner, join_learner(learner, urls, run_dir)


def create_learner(cfg: Config, actor: Any, run_dir: Path) -> Any:
    """The learner actor, created and not waited for (its ``__init__`` runs in its own process);
    :func:`join_learner` waits for it."""
    return actor(Learner, "learner").remote(cfg.learner, cfg.model, cfg.transport, cfg.weight_sync, str(run_dir),
                                            generation=cfg.generation, seed=cfg.run.seed,
                                            torch_threads=cfg.run.torch_threads, sampler_backend=cfg.sampler.backend,
                                            max_context_tokens=cfg.env.max_context_tokens)


def join_learner(learner: Any, urls: list[str], run_dir: Path) -> str:
    """Wait for ``learner`` (:func:`create_learner`) to start, join it to every sampler's weight
    group with version 0 published; its ZeroMQ endpoint.

    Raises:
        LearnerStartFailed: as :func:`start_learner` (the actor is killed).
    """
    try:
        endpoint = ray.get(learner.endpoint.remote())
        ray.get(learner.connect_samplers.remote(urls))
    except ray.exceptions.RayError as e:
        _try(lambda: ray.kill(learner))
        raise LearnerStartFailed(f"the learner failed to start: {error_line(e)} (traceback in "
                                 f"{run_dir}/logs/learner.log)") from None
    return endpoint


def restart_learner(cfg: Config, actor: Any, run_dir: Path, urls: list[str], endpoint: str) -> Any:
    """A new learner after one died: resumed from the last checkpoint and the receive log
    (``learner.resume``), bound to the same endpoint (the rollout actors reconnect and resend
    what it had not acknowledged) and joined to the samplers in a new weight group."""
    cfg = copy.deepcopy(cfg)
    cfg.learner.resume = True
    if cfg.transport.scheme == "tcp":
        cfg.transport.port = int(endpoint.rsplit(":", 1)[1])
    learner, _ = start_learner(cfg, actor, run_dir, urls)
    announce_resume(cfg, learner, run_dir)
    return learner


def restart_controller(cfg: Config, actor: Any, task_names: list[str], urls: list[str], endpoint: str,
                       learner: Any) -> tuple[Any, Any]:
    """A new controller after one died (Ray's memory monitor, kill -9), with new rollout actors:
    its task order and admission continue from ``learner``, a learner just restarted from its
    checkpoint (its ``resumed`` status, as a resumed launch's controller does); the tasks are the
    live ``env.tasks`` if set, else ``task_names``. Returns :func:`start_controller`'s pair."""
    st = ray.get(learner.status.remote(), timeout=60)
    resumed = {**st["resumed"], "trained": st.get("trained", 0)} if st.get("resumed") else None
    return start_controller(cfg, actor, list(cfg.env.tasks) or task_names, urls, endpoint,
                            task_order=saved_task_order(resumed and resumed["checkpoint"]), resumed=resumed)


def start_controller(cfg: Config, actor: Any, task_names: list[str], urls: list[str], endpoint: str,
                     task_order: dict[str, Any] | None = None, resumed: dict[str, Any] | None = None) -> Any:
    """The controller, running its supervision loop, which starts and replaces the rollout actors;
    its task order continues ``task_order`` (a resumed checkpoint's, :func:`saved_task_order`) and
    its admission the resumed learner's position (``resumed``: :func:`announce_resume`'s).
    Returns the controller and its supervision loop's ObjectRef (ready when it stops or dies)."""
    rollout_cls = actor(RolloutActor, "rollout")
    work_root = str(Path(cfg.run.dir) / "workspaces")

    def make_rollout(actor_id: int, crash_after: int) -> Any:
        return rollout_cls.remote(actor_id, cfg.env, cfg.generation, cfg.model, cfg.transport, urls, endpoint,
                                  crash_after_episodes=crash_after, request_timeout_s=cfg.sampler.request_timeout_s,
                                  work_root=work_root, log_name=f"rollout{actor_id}",
                                  audit_dir=str(Path(cfg.run.dir) / "audit") if cfg.run.audit else None,
                                  rollout_cfg=cfg.rollout, seed=cfg.run.seed)

    controller = actor(Controller, "controller").remote(
        cfg.rollout, task_names, rollouts_per_version=cfg.learner.batch_size * cfg.learner.publish_every,
        max_staleness=cfg.learner.max_staleness, make_rollout=make_rollout, seed=cfg.run.seed, sampler_urls=urls,
        task_order=task_order, resumed=resumed)
    return controller, controller.run.remote()


def shutdown(roles: dict[str, Any], grace_s: float = 5.0) -> dict[str, Any]:
    """Stop admission and the rollout actors (each gets ``grace_s`` to finish and spool its
    episode), read the samplers' versions, close the learner."""
    out: dict[str, Any] = {}
    if roles.get("controller") is not None:
        out["controller"] = _try(lambda: ray.get(roles["controller"].stop.remote(grace_s), timeout=30 + grace_s))
    if roles.get("samplers"):
        out["samplers"] = _try(lambda: ray.get([s.stats.remote() for s in roles["samplers"]], timeout=30))
    if roles.get("learner") is not None:
        _try(lambda: ray.get(roles["learner"].close.remote(), timeout=30))
    return out


def add_log_sink(run_dir: Path, name: str, run_cfg: RunConfig, *, keep_stderr: bool = False) -> None:
    """Send this process's loguru records to ``RUN_DIR/logs/NAME.log`` (rotated at
    ``run.log_rotation``, ``run.log_retention`` old files kept) and, if asked, to stderr (looked up
    at each write, so a live status line can redirect it)."""
    logger.remove()
    if keep_stderr:
        logger.add(lambda m: sys.stderr.write(m), level="INFO", colorize=sys.stderr.isatty(),
                   format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")
    (run_dir / "logs").mkdir(exist_ok=True)
    logger.add(run_dir / "logs" / f"{name}.log", level="DEBUG", enqueue=False, rotation=run_cfg.log_rotation,
               retention=run_cfg.log_retention)


def _log_start_failure(name: str) -> None:
    """Log the exception being handled, with its traceback, as actor ``name``'s start-up failure (a
    module-level function: Ray pickles the actor classes of :func:`_actor_factory` by value, and
    the logger with its open files must not travel with them)."""
    logger.exception("{} failed to start", name)


def placement_options(role: str, resource: str, nodes: list[dict[str, Any]], turn: int = 0,
                      reachable: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
    """Ray actor options that place one actor of ``role`` on a live node marked with ``resource``
    (``ray.placement``); ``{}`` (any node) when no such node is left: the soft fallback after a
    node loss, logged as a warning.

    A node counts as live when Ray's node table says so and its raylet accepts a TCP connection
    (``reachable``): Ray takes a health-check period to mark a lost node dead (13 s in ``t1async
    bench multinode``), and an actor sent there meanwhile dies with it. The live nodes are taken in
    turn (``turn``, counted by the caller: successive actors of a role go round the nodes), soft:
    should the node be lost before the actor starts, Ray puts it on another node with the resource.

    Args:
        role: the role's name (for the warning).
        resource: the custom resource marking the role's nodes.
        nodes: Ray's node table (``ray.nodes()``: dicts with ``NodeID``, ``Alive``, ``Resources``,
            ``NodeManagerAddress``, ``NodeManagerPort``).
        turn: how many actors of this role the caller placed before.
        reachable: ``node -> bool``; default :func:`raylet_reachable`.
    """
    reachable = reachable or raylet_reachable
    marked = sorted((n for n in nodes if n.get("Alive") and n.get("Resources", {}).get(resource, 0) > 0),
                    key=lambda n: n["NodeID"])
    live = [n for n in marked if reachable(n)]
    if not live:
        logger.warning("ray.placement: no live Ray node has resource {!r} for the {}; starting it on any node "
                       "(join a node with ray start --resources '{{\"{}\": 1}}' to place it there again)",
                       resource, role, resource)
        return {}
    node = live[turn % len(live)]
    return {"resources": {resource: PLACEMENT_SHARE},
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=True)}


def raylet_reachable(node: dict[str, Any], timeout_s: float = 1.0) -> bool:
    """Whether the raylet of a row of ``ray.nodes()`` accepts a TCP connection within ``timeout_s``
    (a lost machine's port refuses at once or times out)."""
    try:
        with socket.create_connection((node["NodeManagerAddress"], int(node["NodeManagerPort"])), timeout=timeout_s):
            return True
    except (OSError, KeyError, ValueError):
        return False


class PlacedActor:
    """A Ray actor class whose ``.remote(...)`` places each new actor by :func:`placement_options`,
    looked up at that moment (so a restart after a node loss sees the nodes still alive) and
    taking the role's nodes in turn (``turns``: role -> actors placed so far, shared by the
    placed classes of one process). Picklable: the controller starts rollout actors through one."""

    def __init__(self, actor_class: Any, role: str, resource: str, turns: dict[str, int] | None = None):
        self.actor_class, self.role, self.resource = actor_class, role, resource
        self.turns = turns if turns is not None else {}

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Start one actor (``ActorClass.options(...).remote(*args, **kwargs)``); its handle."""
        turn = self.turns.get(self.role, 0)
        self.turns[self.role] = turn + 1
        options = placement_options(self.role, self.resource, ray.nodes(), turn)
        return self.actor_class.options(**options).remote(*args, **kwargs)


def _actor_factory(run_dir: Path, run_cfg: RunConfig, ray_cfg: RayConfig | None = None):
    """``actor(cls, log_name)`` -> a Ray actor class whose instances log to ``RUN_DIR/logs/``
    (a :class:`PlacedActor` for a role in ``ray.placement``).

    Actors take no CPU reservation: on a 2-core machine all roles share the cores, and each
    limits torch to ``run.torch_threads`` threads.
    """
    placement = ray_cfg.placement if ray_cfg is not None else {}
    turns: dict[str, int] = {}  # role -> actors placed so far (samplers get a class each: one count)

    def actor(cls: type, default_log_name: str):
        class Logged(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, log_name: str = default_log_name, **kwargs: Any):
                add_log_sink(run_dir, log_name, run_cfg)
                os.environ.setdefault("OMP_NUM_THREADS", "1")
                try:
                    super().__init__(*args, **kwargs)
                except BaseException:  # the traceback goes to this actor's log; launch reports one line
                    _log_start_failure(cls.__name__)
                    raise

        Logged.__name__ = Logged.__qualname__ = cls.__name__
        remote = ray.remote(num_cpus=0, max_concurrency=ACTOR_MAX_CONCURRENCY, max_restarts=0)(Logged)
        resource = placement.get(ROLE_OF.get(cls.__name__, ""))
        return PlacedActor(remote, ROLE_OF[cls.__name__], resource, turns) if resource else remote

    return actor


def keep_ray_logs(session_dir: str | None, run_dir: Path) -> None:
    """Move the logs of a Ray session this launch started to ``RUN_DIR/logs/ray`` (replacing an
    earlier life's) and delete the session folder, so that no launch leaves a folder in the system
    temp directory. Failures are logged, never raised (the run is over)."""
    if not session_dir or not Path(session_dir).is_dir():
        return
    session = Path(session_dir)
    dest = run_dir / "logs" / "ray"
    try:
        if (session / "logs").is_dir():
            shutil.rmtree(dest, ignore_errors=True)
            shutil.move(str(session / "logs"), str(dest))
        shutil.rmtree(session, ignore_errors=True)
    except OSError as e:
        logger.warning("could not move Ray's session logs from {} to {}: {}", session, dest, e)


def _metrics_summary(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"steps": 0}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return {"steps": 0}
    n = sum(r["trajectories"] for r in rows)
    return {
        "steps": rows[-1]["step"],
        "final_version": rows[-1]["version"],
        "trajectories": n,
        "dropped_stale": rows[-1]["dropped_stale"],
        "dropped": rows[-1].get("dropped", {}),  # (absent from rows written before it existed)
        "reward_mean": sum(r["reward_mean"] * r["trajectories"] for r in rows) / n,
        "resolved_rate": sum(r["resolved_rate"] * r["trajectories"] for r in rows) / n,
        "staleness_max": max(r["staleness_max"] for r in rows),
    }


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # shutdown must go on even if one role is already gone
        logger.warning("shutdown step failed: {}", e)
        return {"error": str(e)}

