"""``t1async launch``: the table of contents of the whole system.

    config -> input checks (tokenizer, tasks, sandbox, keys) -> run directory -> Ray
           -> samplers (HTTP, SGLang protocol) -> learner (ZeroMQ ROUTER, weight group, version 0)
           -> controller (admission, supervision) -> rollout actors (episodes -> ZeroMQ DEALER, ACKed)
           -> wait for the learner's max_steps (or Ctrl-C / SIGTERM) -> stop everything -> summary

This is the only core module that touches Ray and the environment layer; the roles are plain
classes in ``t1async.actors`` and get ``ray.remote`` here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loguru import logger

from t1async.config import Config, ConfigError, check_trainable, load_config, to_yaml
from t1async.envs.limits import unmount_all_under
from t1async.tokenizer import ChatTokenizer

ACTOR_MAX_CONCURRENCY = 64  # threads of the controller/learner/sampler actors (acquire() waits block one each)


def launch(config_path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the asynchronous RL loop described by ``config_path`` and ``overrides`` to completion.

    Returns:
        The run summary (also written to ``RUN_DIR/summary.json``).

    Raises:
        ConfigError, TaskError, SandboxUnavailable, KeysError: bad input, before anything is started.
    """
    import ray

    cfg = load_config(config_path, overrides)
    task_names = check_inputs(cfg)  # every bad-input error happens here, before any process starts
    run_dir = prepare_run_dir(cfg)
    cfg.transport.spool_dir = cfg.transport.spool_dir or str(run_dir / "spool")  # resent by a resumed run
    logger.info("run directory: {}", run_dir)
    logger.info("{} tasks, {} rollout actors, {} samplers, {} learner steps", len(task_names), cfg.rollout.num_actors,
                cfg.sampler.num_samplers, cfg.learner.max_steps)
    t_start = time.time()
    ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    actor = _actor_factory(run_dir)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "max_steps": cfg.learner.max_steps}
    roles: dict[str, Any] = {}
    try:
        roles["samplers"], urls = start_samplers(cfg, actor)
        roles["learner"], endpoint = start_learner(cfg, actor, run_dir, urls)  # publishes weight version 0
        roles["controller"] = start_controller(cfg, actor, task_names, urls, endpoint)  # starts the rollout actors
        summary["learner"], summary["interrupted"] = _wait_for_learner(roles["learner"], roles["controller"])
    finally:
        summary.update(shutdown(roles))
        unmount_all_under(run_dir / "workspaces")  # killed actors cannot clean up themselves
        shutil.rmtree(run_dir / "workspaces", ignore_errors=True)
        summary["wall_s"] = round(time.time() - t_start, 1)
        summary.update(_metrics_summary(run_dir / "metrics.jsonl"))
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        ray.shutdown()
    logger.info("done: {}", json.dumps({k: v for k, v in summary.items() if k not in ("samplers",)}, default=str))
    return summary


def check_inputs(cfg: Config) -> list[str]:
    """Check that the config can be trained on (:func:`~t1async.config.check_trainable`) and what it
    points at (tokenizer, tasks, sandbox, CURVE keys); returns the task names.

    Raises:
        ConfigError, TaskError, SandboxUnavailable, KeysError: with a one-line message.
    """
    from t1async.actors.rollout import tasks_dir
    from t1async.envs.sandbox import check_sandbox_available
    from t1async.envs.task import discover_tasks

    check_trainable(cfg)
    vocab = ChatTokenizer.load().vocab_size
    if cfg.model.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab} ids; "
                          f"use model.vocab_size >= {vocab}")
    tasks = discover_tasks(tasks_dir(cfg.env), cfg.env.tasks, sandbox=cfg.env.sandbox)
    check_sandbox_available(cfg.env.sandbox)
    if cfg.transport.curve:
        from t1async.keys import client_keys, server_keys

        server_keys(cfg.transport.keys_dir)
        client_keys(cfg.transport.keys_dir)
    return [t.name for t in tasks]


def start_samplers(cfg: Config, actor: Any) -> tuple[list[Any], list[str]]:
    """M embedded samplers (HTTP, SGLang protocol; no weights until the learner publishes); their URLs."""
    import ray

    from t1async.actors.sampler import EmbeddedSampler

    samplers = [actor(EmbeddedSampler, f"sampler{i}").remote(cfg.model, cfg.sampler, seed=cfg.run.seed + i,
                                                             torch_threads=cfg.run.torch_threads)
                for i in range(cfg.sampler.num_samplers)]
    return samplers, ray.get([s.url.remote() for s in samplers])


def start_learner(cfg: Config, actor: Any, run_dir: Path, urls: list[str]) -> tuple[Any, str]:
    """The learner, joined to every sampler's weight group with version 0 published; its ZeroMQ endpoint."""
    import ray

    from t1async.actors.learner import Learner

    learner = actor(Learner, "learner").remote(cfg.learner, cfg.model, cfg.transport, cfg.weight_sync, str(run_dir),
                                               generation=cfg.generation, seed=cfg.run.seed,
                                               torch_threads=cfg.run.torch_threads)
    endpoint = ray.get(learner.endpoint.remote())
    ray.get(learner.connect_samplers.remote(urls))
    return learner, endpoint


def start_controller(cfg: Config, actor: Any, task_names: list[str], urls: list[str], endpoint: str) -> Any:
    """The controller, running its supervision loop, which starts and replaces the rollout actors."""
    from t1async.actors.controller import Controller
    from t1async.actors.rollout import RolloutActor

    rollout_cls = actor(RolloutActor, "rollout")
    work_root = str(Path(cfg.run.dir) / "workspaces")

    def make_rollout(actor_id: int, crash_after: int) -> Any:
        return rollout_cls.remote(actor_id, cfg.env, cfg.generation, cfg.model, cfg.transport, urls, endpoint,
                                  crash_after_episodes=crash_after, request_timeout_s=cfg.sampler.request_timeout_s,
                                  work_root=work_root, log_name=f"rollout{actor_id}")

    controller = actor(Controller, "controller").remote(
        cfg.rollout, task_names, rollouts_per_version=cfg.learner.batch_size * cfg.learner.publish_every,
        max_staleness=cfg.learner.max_staleness, make_rollout=make_rollout, seed=cfg.run.seed)
    controller.run.remote()
    return controller


def shutdown(roles: dict[str, Any]) -> dict[str, Any]:
    """Stop admission and the rollout actors, read the samplers' versions, close the learner."""
    import ray

    out: dict[str, Any] = {}
    if roles.get("controller") is not None:
        out["controller"] = _try(lambda: ray.get(roles["controller"].stop.remote(), timeout=30))
    if roles.get("samplers"):
        out["samplers"] = _try(lambda: ray.get([s.stats.remote() for s in roles["samplers"]], timeout=30))
    if roles.get("learner") is not None:
        _try(lambda: ray.get(roles["learner"].close.remote(), timeout=30))
    return out


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input (reported by the CLI in one line, without a traceback)."""
    from t1async.envs.sandbox import SandboxUnavailable
    from t1async.envs.task import TaskError
    from t1async.keys import KeysError

    return ConfigError, TaskError, SandboxUnavailable, KeysError


def prepare_run_dir(cfg: Config) -> Path:
    """Create the run directory, save the resolved config, and log there (``t1async.log``)."""
    now = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run.dir.format(now=now)).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run.dir {run_dir} cannot be created ({e.strerror}); pick a writable folder") from None
    cfg.run.dir = str(run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    add_log_sink(run_dir, "t1async", keep_stderr=True)
    return run_dir


def add_log_sink(run_dir: Path, name: str, *, keep_stderr: bool = False) -> None:
    """Send this process's loguru records to ``RUN_DIR/logs/NAME.log`` (and stderr if asked)."""
    logger.remove()
    if keep_stderr:
        logger.add(sys.stderr, level="INFO", format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")
    (run_dir / "logs").mkdir(exist_ok=True)
    logger.add(run_dir / "logs" / f"{name}.log", level="DEBUG", enqueue=False)


def _actor_factory(run_dir: Path):
    """``actor(cls, log_name)`` -> a Ray actor class whose instances log to ``RUN_DIR/logs/``.

    Actors take no CPU reservation: on a 2-core machine all roles share the cores, and each
    limits torch to ``run.torch_threads`` threads.
    """
    import ray

    def actor(cls: type, default_log_name: str):
        class Logged(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, log_name: str = default_log_name, **kwargs: Any):
                add_log_sink(run_dir, log_name)
                os.environ.setdefault("OMP_NUM_THREADS", "1")
                super().__init__(*args, **kwargs)

        Logged.__name__ = Logged.__qualname__ = cls.__name__
        return ray.remote(num_cpus=0, max_concurrency=ACTOR_MAX_CONCURRENCY, max_restarts=0)(Logged)

    return actor


def _wait_for_learner(learner: Any, controller: Any) -> tuple[dict[str, Any], bool]:
    """Wait for the learner's run, printing progress; on Ctrl-C or SIGTERM ask it to stop and write its final checkpoint.

    Returns:
        ``(learner status, interrupted)``.
    """
    import signal

    import ray

    def _terminate(signum: int, frame: Any) -> None:  # SIGTERM (a service manager's stop) acts as Ctrl-C
        raise KeyboardInterrupt

    run_ref = learner.run.remote(controller)
    # Both set explicitly: a launch started in the background by a script inherits SIGINT ignored
    # (POSIX shells do that to `&` jobs), and Python then leaves it ignored; `kill -INT` must still stop it.
    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGINT, signal.SIGTERM)}
    last_step = -1
    try:
        while True:
            ready, _ = ray.wait([run_ref], timeout=5.0)
            if ready:
                return ray.get(run_ref), False
            st = ray.get(learner.status.remote())
            if st["step"] != last_step:
                last_step = st["step"]
                logger.info("learner step {step}, version {version}, received {received}, queue {queue_depth}", **st)
    except KeyboardInterrupt:
        logger.warning("Ctrl-C/SIGTERM: stopping the learner after its current step (final checkpoint follows)")
        ray.get(learner.stop.remote())
        return ray.get(run_ref), True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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

