"""Launch's pre-flight: every check of the input made before any process starts.

    config file + overrides -> load_config (each section's rules, the cross rules)
      -> run directory resolved; on a resume: it must hold a run, and its live-change history
         (t1async scale) is applied again -> check_trainable -> init checkpoint, tokenizer vocabulary,
         the endpoint's extra, tasks, sandbox, transport port, SGLang log-prob environment,
         weight-sync hosts, CURVE keys

:func:`preflight` is the one call ``t1async launch`` makes; each refusal is one line naming the
key, the value and what to do (exit status 2). It creates nothing: the run directory is claimed
afterwards, under its lock (t1async/service/rundir.py, which also refuses to mix two runs there).
:func:`check_tasks` is also the check of a live ``env.tasks`` change.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from loguru import logger

from t1async import require_extra
from t1async.actors.rollout import tasks_dir
from t1async.config import Config, ConfigError, agent_weights, check_trainable, load_config
from t1async.envs.sandboxes.sandbox import check_sandbox_available
from t1async.envs.taskio.loading import discover_tasks, task_folders
from t1async.envs.taskio.task import Task, TaskError
from t1async.learner.checkpoints import resume_from_nothing, untrusted_checkpoints
from t1async.learner.megatron.families import check_family
from t1async.learner.megatron.plan import check_layout_fits
from t1async.models.families import check_model_folder, check_sampler_names, load_renderer
from t1async.models.tokenizer import check_model_vocab
from t1async.rollout.conversation import template_tool_format
from t1async.rollout.episode import context_limit
from t1async.rollout.harnesses import HARNESSES, check_sandbox
from t1async.sampling.sglang_server import check_logprob_env
from t1async.service.rundir import earlier_run, history_overrides, resolve_run_dir
from t1async.transport.keys import client_keys, server_keys


def check_sglang_model_path(model_path: str, sampler_model_path: str) -> None:
    """With ``model.path`` the SGLang servers start from it (t1async/service/launch.py ``sglang_model_dir``):
    a ``sampler.model_path`` naming another folder would give learner and servers different models.

    Raises:
        ConfigError: one line with both paths; equal paths (after ``~`` and symlinks) or an empty
            ``sampler.model_path`` pass.
    """
    if not model_path or not sampler_model_path:
        return
    if Path(model_path).expanduser().resolve() != Path(sampler_model_path).expanduser().resolve():
        raise ConfigError(f"sampler.model_path={sampler_model_path} differs from model.path={model_path}: with model.path "
                          "the SGLang servers start from model.path (the learner's model); drop sampler.model_path")


def check_sglang_servers_can_start(sampler: Any) -> None:
    """Servers that launch starts (no ``sampler.urls``) run ``python -m sglang.launch_server`` with this
    Python and environment (t1async/sampling/sglang_server.py ``sglang_command``): refuse at once when that
    Python has no ``sglang`` package (found with ``importlib.util.find_spec`` in a child process with the
    servers' environment, ``PYTHONPATH`` included; nothing imported), or when ``sampler.model_path`` is a
    local folder that is not a model folder (no ``config.json``; a path that does not exist may be a hub id,
    which SGLang resolves itself).

    Raises:
        ConfigError: one line naming the Python or the folder and what to do.
    """
    if sampler.urls:
        return
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sglang') else 3)"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60).returncode != 0:
        raise ConfigError(f"sampler.backend=sglang starts servers with {sys.executable} -m sglang.launch_server, but "
                          "that Python has no sglang package: install SGLang there (a GPU machine: pip install "
                          "'sglang[all]'), or attach running servers with sampler.urls=[http://HOST:PORT]")
    folder = Path(sampler.model_path).expanduser() if sampler.model_path else None
    if folder is not None and folder.is_dir() and not (folder / "config.json").is_file():
        raise ConfigError(f"sampler.model_path={sampler.model_path} has no config.json: give the Hugging Face model "
                          "folder the servers load (or model.path, which the learner and the servers then share)")


def preflight(config_path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, Path, list[str]]:
    """Load the config of a launch and check everything it names, before anything starts.

    Returns:
        ``(cfg, run_dir, task_names)``: the checked config (on a resume with the run's live
        changes applied again, then ``overrides``), the resolved absolute run directory (not
        created) and the names of the tasks episodes are drawn from.

    Raises:
        ConfigError, TaskError, SandboxUnavailable, KeysError: one line (a task folder with several
            broken tasks: one line per task).
    """
    cfg = load_config(config_path, overrides)
    run_dir = resolve_run_dir(cfg.run.dir)
    if cfg.learner.resume:  # live changes made to the run before (t1async scale) are kept
        check_resumable(run_dir, from_scratch=cfg.learner.resume_from_scratch)  # (nor a mistyped run.dir)
        cfg = load_config(config_path, [*history_overrides(run_dir), *overrides])
    return cfg, run_dir, check_inputs(cfg)


def check_resumable(run_dir: Path, *, from_scratch: bool = False) -> None:
    """Refuse ``learner.resume=true`` into a folder that holds no run (a mistyped path, a new
    ``{now}`` folder): resuming it would silently start from scratch. Nothing is created.

    Also refuses a run whose checkpoints all fail verification by name and size
    (:func:`~t1async.learner.checkpoints.untrusted_checkpoints`; the learner checks their digests),
    and, unless ``from_scratch`` (``learner.resume_from_scratch``), one whose checkpoints are all
    gone although it wrote some (:func:`~t1async.learner.checkpoints.resume_from_nothing`).

    Raises:
        ConfigError: ``run_dir`` does not exist or holds none of :data:`~t1async.service.rundir.EARLIER_RUN`,
            or no checkpoint of it can be trusted.
    """
    if earlier_run(run_dir) is not None:
        why = untrusted_checkpoints(Path(run_dir) / "checkpoints", digests=False)
        if why:  # resuming would train again from the initial weights, throwing the run's training away
            raise ConfigError(f"learner.resume=true but {why}: a resume would start again from the initial "
                              "weights; put an intact step_N folder back there, or start a new run in another run.dir")
        gone = resume_from_nothing(Path(run_dir))
        if gone and not from_scratch:
            raise ConfigError(f"learner.resume=true but {gone}: a resume would start again from the initial weights "
                              "and cut metrics.jsonl back; put the step_N folder back, or add "
                              "learner.resume_from_scratch=true to start over on purpose")
        return
    what = "does not exist" if not Path(run_dir).exists() else "holds no run (no metrics, checkpoints or receive log)"
    raise ConfigError(f"learner.resume=true but run.dir {run_dir} {what}; check the path (t1async status RUN_DIR "
                      "shows a running one), or drop learner.resume=true to start a new run")


def check_inputs(cfg: Config) -> list[str]:
    """Check that the config can be trained on (:func:`~t1async.config.check_trainable`) and what it
    points at (tokenizer, tasks, sandbox, CURVE keys); returns the task names.

    Raises:
        ConfigError, TaskError, SandboxUnavailable, KeysError: with a one-line message.
    """
    check_trainable(cfg)
    check_init_checkpoint(cfg.learner.init_checkpoint)
    if cfg.learner.backend == "megatron" and cfg.learner.megatron.gpu_memory_gib > 0:  # the layout fits its GPUs
        check_layout_fits(cfg.model, cfg.learner, cfg.learner.megatron.gpu_memory_gib)
    if cfg.learner.backend == "megatron" and cfg.model.path:  # a family setting megatron-core cannot express
        try:
            check_family(cfg.model)
        except ValueError as e:
            raise ConfigError(f"learner.backend=megatron with model.path={cfg.model.path}: {e}") from None
    if cfg.model.path:  # the folder's weights, tokenizer, template and size, before anything starts
        facts = check_model_folder(cfg.model, backend=cfg.learner.backend)
        logger.info("model.path={}: {} {:.1f} M parameters, {} tokenizer ids", cfg.model.path, cfg.model.model_type,
                    facts["parameters"] / 1e6, facts["vocab"])
        if cfg.env.action_format == "tool_call":  # the template's own tool-call format, before anything starts
            try:
                template_tool_format(load_renderer(cfg.model))
            except ValueError as e:
                raise ConfigError(f"env.action_format=tool_call with model.path={cfg.model.path}: {e}") from None
    else:
        check_model_vocab(cfg.model.vocab_size, cfg.env.action_format)
    others = sorted(set(agent_weights(cfg.rollout.agent)) - {"builtin"})  # agents that talk to the endpoint
    if others and not cfg.model.path:  # ChatML: tool calls with the tool-call ids
        check_model_vocab(cfg.model.vocab_size, "tool_call", f"model.vocab_size (rollout.agent {', '.join(others)})")
    if others:
        for module in ("fastapi", "uvicorn"):  # the endpoint's extra, before any process starts
            require_extra(module, "endpoint", f"rollout.agent {', '.join(others)}")
    check_harnesses([a for a in others if a in HARNESSES], cfg.env.sandbox, str(cfg.env.network),
                    0 if cfg.model.path else context_limit(cfg.env, cfg.model))
    if cfg.metrics.wandb:  # (its extra, before any process starts)
        require_extra("wandb", "wandb", "metrics.wandb=true")
    tasks = usable_tasks(cfg)
    check_sandbox_available(cfg.env.sandbox)
    check_port_free(cfg.transport)
    if cfg.sampler.backend == "sglang":
        check_sglang_model_path(cfg.model.path, cfg.sampler.model_path)
    if cfg.sampler.backend == "sglang" and not cfg.sampler.urls and not cfg.sampler.model_path and not cfg.model.path:
        raise ConfigError("sampler.backend=sglang needs sampler.urls (running servers), model.path or sampler.model_path "
                          "(a Hugging Face model folder for the servers launch starts)")
    if cfg.sampler.backend == "sglang":
        check_sampler_names(cfg.model, "sglang")  # names its loader would skip: servers never updated
        check_sglang_servers_can_start(cfg.sampler)
        check_logprob_env(cfg.generation.temperature)
    check_weight_sync_hosts(cfg)
    if cfg.sampler.backend == "sglang" and cfg.weight_sync.mode == "distributed" and cfg.weight_sync.backend != "nccl":
        logger.warning("sampler.backend=sglang with weight_sync.backend={}: SGLang servers receive on GPUs, "
                       "use weight_sync.backend=nccl", cfg.weight_sync.backend)
    if cfg.learner.advantage == "group" and cfg.rollout.group_size < 2:
        logger.warning("learner.advantage=group with rollout.group_size={}: a task's episodes rarely meet in "
                       "the learner's window, so most trajectories fall back to GAE (group_baselined_frac in "
                       "metrics.jsonl); set rollout.group_size=4 or so", cfg.rollout.group_size)
    check_transport_auth(cfg)
    return [t.name for t in tasks]


def check_harnesses(names: list[str], sandbox: str, network: str, context: int = 0) -> list[str]:
    """Refuse, before any process starts, named harnesses (``rollout.agent``) that could not run one episode: not
    installed, or not in this ``env.sandbox`` (:func:`~t1async.rollout.harnesses.check_sandbox`), or in a
    bubblewrap sandbox without ``env.network=on`` (the harness reaches the rollout actor's endpoint on the host's
    loopback; a sandbox without network has a loopback of its own). Without this the rollout actors refused to
    start, or every episode failed with "connection refused", and the launch printed nothing about it.

    A harness whose first request is larger than ``context`` (tokens; 0: unknown) would end every episode
    ``context_full`` before its first completion: that is warned, one line per harness, and returned.

    Raises:
        ConfigError: one line naming the harness, what is wrong and what to do.
    """
    for name in names:
        try:
            check_sandbox(name, sandbox)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if names and sandbox == "local" and network != "on":
        raise ConfigError(f"rollout.agent {', '.join(names)} with env.sandbox=local and env.network={network}: a "
                          "harness reaches the rollout actor's endpoint on the host's loopback, which a bubblewrap "
                          "sandbox has only with network; add env.network=on (or use env.sandbox=container, which "
                          "keeps the task's network)")
    warnings = [f"rollout.agent {name}: its first request holds about {HARNESSES[name].first_request_tokens:,} tokens "
                f"and this run's context is {context:,}: every {name} episode will end context_full before its first "
                "completion; raise model.max_position_embeddings (e.g. 65536)"
                for name in names if context and HARNESSES[name].first_request_tokens > context]
    for line in warnings:
        logger.warning(line)
    return warnings


def usable_tasks(cfg: Config) -> list[Task]:
    """The tasks episodes are drawn from: those named in ``env.tasks``, or, when none are named,
    every valid task under the tasks folder. A broken task folder (invalid, or one the chosen
    sandbox refuses) is skipped with one warning line each and a count, as one bad message is
    skipped; the launch is refused only when no task is usable (then every broken folder is
    named, one line each). A named task that is broken or missing is still refused: the
    operator asked for it by name.

    Raises:
        TaskError: no usable task, a named task missing or broken, two tasks sharing a name, no
            tasks folder.
    """
    root = tasks_dir(cfg.env)
    if cfg.env.tasks:
        return discover_tasks(root, cfg.env.tasks, sandbox=cfg.env.sandbox)
    try:
        return discover_tasks(root, sandbox=cfg.env.sandbox)
    except TaskError as e:
        broken = e
    logger.disable("t1async.envs.taskio.loading")  # (its own line per skipped folder: said below, once)
    try:
        tasks = discover_tasks(root, sandbox=cfg.env.sandbox, skip_invalid=True)
    except TaskError as e:
        if str(e).startswith("no valid task"):
            raise broken from None  # every folder broken: name each
        raise
    finally:
        logger.enable("t1async.envs.taskio.loading")
    lines = str(broken).splitlines()
    for line in lines[1:] or lines:  # (several: a count line, then one line each)
        logger.warning("skipping a broken task folder: {}", line.strip())
    skipped = len(task_folders(root)) - len(tasks)
    logger.warning("{} of {} task folders under {} are broken and skipped; episodes are drawn from the other {}: "
                   "fix them, or name the good ones in env.tasks", skipped, skipped + len(tasks), root, len(tasks))
    return tasks


def check_transport_auth(cfg: Config) -> None:
    """The learner's trajectory socket must authenticate its senders wherever another machine can
    reach it: ``transport.curve=false`` is refused unless it binds a loopback address or uses
    ``scheme: ipc`` (a forged frame on an open port was ACKed and trained: issue 42), and a Ray
    cluster of several machines (``ray.address``) needs ``transport.keys_dir`` (a folder every
    machine reads; ``RUN_DIR/keys``, made at launch, serves one host). Given keys are read now.

    Raises:
        ConfigError: one line naming the key and what to set.
        KeysError: ``transport.keys_dir`` lacks a key file (:func:`~t1async.transport.keys.server_keys`).
    """
    t = cfg.transport
    if not t.curve:
        if t.scheme == "tcp" and not is_loopback(t.host):
            raise ConfigError(f"transport.curve=false with transport.host={t.host}: anyone who reaches that port could "
                              "train the policy; keep transport.curve=true (keys are made at launch, or give "
                              "transport.keys_dir from t1async keys DIR), or bind transport.host=127.0.0.1")
        return
    if not t.keys_dir:
        if cfg.ray.address not in (None, "", "local"):
            raise ConfigError(f"transport.keys_dir is needed with ray.address={cfg.ray.address}: the keys made at "
                              "launch serve one machine; run t1async keys DIR on a folder every machine reads and "
                              "set transport.keys_dir=DIR")
        return
    server_keys(t.keys_dir)
    client_keys(t.keys_dir)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name) is this machine's loopback: only its own processes reach it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_init_checkpoint(path: str) -> None:
    """Refuse a ``learner.init_checkpoint`` that is not a checkpoint folder (before Ray starts and
    before the run directory is created, instead of a Ray traceback from the learner's start).

    Raises:
        ConfigError: one line: the folder is missing, or lacks ``config.json`` or ``model.safetensors``.
    """
    if not path:
        return
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"learner.init_checkpoint={path}: no such folder; give a checkpoint folder (config.json + "
                          "model.safetensors, e.g. what t1async sft --out writes) or '' for a random init")
    missing = [n for n in ("config.json", "model.safetensors") if not (folder / n).is_file()
               and not (n == "model.safetensors" and (folder / "model.safetensors.index.json").is_file())]
    if missing:
        raise ConfigError(f"learner.init_checkpoint={path} has no {' or '.join(missing)}: it is not a checkpoint "
                          "folder (config.json + model.safetensors, e.g. what t1async sft --out writes)")


def is_local_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine: it resolves to an address a socket
    here can bind to (loopback included)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def check_weight_sync_hosts(cfg: Config) -> None:
    """``weight_sync.mode=tensor`` hands samplers handles to the learner's memory (CUDA IPC, shared
    memory), which only a process on the same machine can open: refuse samplers elsewhere.

    Raises:
        ConfigError: one line naming the sampler URL (or ``sampler.host``) that is not this machine.
    """
    if cfg.weight_sync.mode != "tensor":
        return
    for url in cfg.sampler.urls:  # set only with sampler.backend=sglang (config refuses it otherwise)
        host = urllib.parse.urlsplit(url if "://" in url else f"http://{url}").hostname or ""
        if not is_local_host(host):
            raise ConfigError(f"weight_sync.mode=tensor needs samplers on this machine (CUDA IPC / shared memory), "
                              f"but sampler.urls has {url} on host {host!r}; use weight_sync.mode=distributed")
    if cfg.sampler.backend == "embedded" and not is_local_host(cfg.sampler.host):
        raise ConfigError(f"weight_sync.mode=tensor needs samplers on this machine, but sampler.host="
                          f"{cfg.sampler.host!r} is not an address of it; use weight_sync.mode=distributed")


def check_port_free(transport: Any) -> None:
    """Refuse a ``transport.port`` another process already listens on (before Ray starts, so the
    message is one line instead of a Ray traceback).

    Raises:
        ConfigError: the port is busy or the host cannot be bound.
    """
    if transport.scheme != "tcp" or transport.port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((transport.host, transport.port))
        except OSError as e:
            raise ConfigError(f"transport.port={transport.port} on {transport.host} cannot be used ({e.strerror}); "
                              "pick a free port or transport.port=0 (any free port)") from None


def check_tasks(cfg: Config, names: list[str]) -> None:
    """Check that ``names`` can be drawn from (a live ``env.tasks`` change).

    Raises:
        TaskError: a name is missing or its task is invalid.
    """
    discover_tasks(tasks_dir(cfg.env), names, sandbox=cfg.env.sandbox)
