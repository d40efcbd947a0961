"""``t1async eval``: run every task of a folder with one agent and report tests passed per task.

Agents:

* ``oracle``: the task's own solution (``solution/solve.sh`` or TB1 ``solution.sh``);
* ``noop``: does nothing (the environment is built, then verified);
* ``policy:CHECKPOINT``: real multi-turn episodes of a trained policy: the checkpoint
  (``config.json`` + ``model.safetensors``) is loaded into an in-process
  :class:`~t1async.actors.sampler.EmbeddedSampler` and reached through
  :class:`~t1async.sampler_client.HttpSampler`, and each episode is the rollout actor's own
  :func:`~t1async.actors.rollout.run_episode` (the same loop training uses, not a copy).

Semantics are the benchmark harnesses', not training's: by default the processes the agent (or the
oracle) left running stay alive through the tests (``agent_processes="keep"``; training kills them,
``env.keep_agent_processes``), and the network is what the harness gives (``network="harness"``:
TB1 on, TB2 per ``allow_internet``; training: ``env.network``). Each row says which applied and,
when the oracle or the tests failed the way a missing network or a killed server makes them
fail, a ``note`` says so.

Each task yields one :class:`EvalRow`; a task that cannot be loaded, is refused by the backend,
has no oracle, or fails to build is a row with ``error`` set (and counts as unresolved; the CLI
exits 1 when any row has one). Tasks run ``concurrency`` at a time, each in its own sandbox. Bad
input (unknown agent or sandbox, missing ``--config``, an empty tasks folder, an unloadable
checkpoint) raises before any task runs.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from t1async.config import Config, ConfigError, ModelConfig, load_config
from t1async.config.model_folder import resolve_model
from t1async.envs.images.engine import resolve_engine
from t1async.envs.protocol import SandboxError, SandboxUnavailable
from t1async.envs.sandboxes.sandbox import SANDBOXES, check_sandbox_available
from t1async.envs.taskio.loading import load_task, task_folders
from t1async.envs.taskio.task import LAYOUT_HINT, Task, TaskError
from t1async.envs.terminal import DEFAULT_LIMITS, NETWORK_MODES, TerminalEnv, task_limits
from t1async.models.tokenizer import check_model_vocab
from t1async.rollout.episode import run_episode
from t1async.sampling.sampler_client import HttpSampler


@dataclass
class EvalRow:
    """One task's outcome.

    Attributes:
        task: the task's folder name.
        passed: verifier tests passed (0 on error).
        total: verifier tests found (0 on error).
        resolved: every test passed and there was at least one.
        seconds: wall time of the episode including build and verification, seconds.
        error: why the task could not be run or verified (refusal, build failure, parse error,
            verifier timeout), else None.
        network: ``"on"`` or ``"off"``: whether the task's sandbox had network ("" if it never
            got that far).
        agent_processes: ``"kept"`` or ``"killed"``: what happened to the processes the agent left
            running before the tests; None (JSON null) when the tests did not run (a failed build,
            a refusal), so no setting is claimed to have applied.
        note: a likely cause of a failure worth seeing (network off while a command failed for
            lack of it; the agent's processes killed while the tests found no server), else None.
    """

    task: str
    passed: int = 0
    total: int = 0
    resolved: bool = False
    seconds: float = 0.0
    error: str | None = None
    network: str = ""
    agent_processes: str | None = None
    note: str | None = None


AGENT_PROCESSES = ("keep", "kill")
"""Values of ``t1async eval --agent-processes``: keep (the harnesses') or kill (training's)."""

NETWORK_FAILURE = re.compile(
    r"Temporary failure in name resolution|Name or service not known|Could not resolve (?:host|proxy)|"
    r"No address associated with hostname|Network is unreachable|getaddrinfo failed|nodename nor servname|"
    r"Failed to establish a new connection|Could not connect to [\w.-]+:\d+|Failed to fetch https?://|"
    r"Temporary failure resolving|unable to access 'https?://", re.IGNORECASE)
"""Messages of a command that failed for lack of network (resolver, connect, pip, apt, curl, git)."""

REFUSED = re.compile(r"Connection refused|ECONNREFUSED|Failed to connect to [\w.-]+ port \d+", re.IGNORECASE)
"""Messages of a client that found no server listening."""


def failure_note(row: EvalRow, outputs: list[tuple[str, str]], *, network: str, stopped: int) -> str | None:
    """A note for ``row`` when a failure looks caused by the eval's settings, else None.

    Args:
        outputs: (what, text) of the oracle's and the verifier's output, and ``("timeout", line)``
            when the verifier timed out (noted: the row shows 0 passed and no error).
        network: how the network was set, e.g. ``"off (task.toml allow_internet = false)"``;
            "" when it was on.
        stopped: processes of the agent killed before the tests (0 when kept).
    """
    if row.resolved:
        return None
    notes = []
    notes += [f"{text}: scored as a failure (reward 0), as the harnesses score it" for what, text in outputs
              if what == "timeout"]
    for what, text in outputs:
        match = NETWORK_FAILURE.search(text) if network else None
        if match:
            notes.append(f"network was {network} and the {what} failed for lack of it ({match.group(0)!r}; "
                         "--network on gives it network)")
            break
    if stopped:
        for what, text in outputs:
            match = REFUSED.search(text)
            if match and what == "tests":
                notes.append(f"{stopped} process(es) the agent left running were killed before the tests, which then "
                             f"found no server ({match.group(0)!r}; --agent-processes keep keeps them)")
                break
    return "; ".join(notes) or None


def policy_model_config(path: Path, cfg: Config) -> ModelConfig:
    """The model section of a policy checkpoint ``path``: its folder's config.json, with ``cfg.model``'s
    ``chat_template_kwargs`` (the template renders as in the run that trained it); the built-in model's
    checkpoint (no tokenizer.json) takes the shipped tokenizer and ChatML.

    Raises:
        ConfigError: the folder's config.json cannot be read.
    """
    model_cfg = resolve_model(ModelConfig(path=str(path), chat_template_kwargs=dict(cfg.model.chat_template_kwargs)))
    if not (path / "tokenizer.json").is_file() and model_cfg.model_type == "qwen3_moe":
        model_cfg = replace(model_cfg, path="", hf_config={}, chat_template_kwargs={})
    return model_cfg


class PolicyAgent:
    """A checkpoint served in-process for :func:`~t1async.actors.rollout.run_episode`.

    Args:
        checkpoint: folder with ``config.json`` and ``model.safetensors``.
        config: optional YAML (or a loaded :class:`~t1async.config.Config`) whose ``env``,
            ``generation`` and ``sampler`` sections are used (defaults otherwise).

    Raises:
        TaskError: the checkpoint folder is missing or incomplete (a user error).
    """

    def __init__(self, checkpoint: str | Path, config: Any = None):
        # torch and ray: only the policy agent needs the model and the embedded sampler
        from t1async.actors.sampler import EmbeddedSampler  # torch (the embedded engine)
        from t1async.models.families import load_model, load_renderer  # torch

        path = Path(checkpoint)
        if not (path / "config.json").is_file() or not ((path / "model.safetensors").is_file()
                                                         or (path / "model.safetensors.index.json").is_file()):
            raise TaskError(f"policy checkpoint {path} needs config.json and model.safetensors (or shards with "
                            "model.safetensors.index.json), e.g. RUN_DIR/checkpoints/step_000004")
        self.cfg = config if isinstance(config, Config) else load_config(config)
        stage = "config.json"
        try:  # garbage config.json or weights: a user error, reported in one line
            self.model_cfg = policy_model_config(path, self.cfg)
            stage = "the weights"
            model = load_model(self.model_cfg, path)
            stage = "the tokenizer"
            self.tokenizer = load_renderer(self.model_cfg)
        except Exception as exc:
            first = (str(exc).splitlines() or [""])[0][:300]
            raise TaskError(f"policy checkpoint {path}: {stage} cannot be loaded ({type(exc).__name__}: {first}); "
                            "pass a checkpoint folder written by the learner (RUN_DIR/checkpoints/step_N)") from None

        try:  # tool calls need the tool tokens' rows (the command format never checked small test models)
            if self.cfg.env.action_format == "tool_call":
                check_model_vocab(self.model_cfg.vocab_size, "tool_call", f"policy checkpoint {path}: vocab_size")
        except ConfigError as exc:
            raise TaskError(str(exc)) from None
        self.sampler = EmbeddedSampler(self.model_cfg, self.cfg.sampler, seed=self.cfg.run.seed)
        self.sampler.load_weights(model.state_dict(), version=0)
        url = self.sampler.url() if callable(self.sampler.url) else self.sampler.url
        self.client = HttpSampler(url, num_layers=self.model_cfg.routed_layers,
                                  top_k=self.model_cfg.num_experts_per_tok)

    def episode(self, task: Task, env: TerminalEnv) -> tuple[int, int, bool, str | None]:
        """One episode; returns (passed, total, resolved, verifier error)."""

        traj = run_episode(task, env, self.client, self.tokenizer, self.cfg.env, self.cfg.generation,
                           self.model_cfg, actor_id=0)
        return traj.passed, traj.total, traj.resolved, traj.verifier_error

    def close(self) -> None:
        """Stop the in-process sampler."""
        self.sampler.shutdown()


def run_task(folder: Path, agent: str, root: Path, *, sandbox: str = "local", policy: PolicyAgent | None = None,
             env_factory: Callable[[Task, Path], TerminalEnv] | None = None, config: Any = None,
             logs: Path | None = None, network: str = "harness", agent_processes: str = "keep") -> EvalRow:
    """Evaluate one task folder with ``agent`` (``oracle``, ``noop`` or ``policy:...``). Never raises
    for a task's own problems: they become the row's ``error``. ``network`` is one of
    :data:`~t1async.envs.terminal.NETWORK_MODES` (default ``harness``: as the benchmark's harness),
    ``agent_processes`` one of :data:`AGENT_PROCESSES` (default ``keep``: as the harnesses); the
    row records both. With ``logs``, ``logs/<folder
    name>/`` receives ``build.log`` (image builds), ``commands.log`` (each command with its
    output and seconds), ``verifier.txt`` (the verifier's output), ``reward.txt`` (the task's own
    reward, when it wrote one), ``error.txt`` and ``row.json`` (the row, timings included)."""
    started = time.monotonic()
    row = EvalRow(folder.name)
    task_logs = logs / folder.name if logs is not None else None
    if task_logs is not None:
        task_logs.mkdir(parents=True, exist_ok=True)
    outputs: list[tuple[str, str]] = []
    env: TerminalEnv | None = None
    try:
        task = load_task(folder)
        container = config.env.container if config is not None else None
        keep = agent_processes == "keep"
        # An image sandbox gets no file-size rlimit, as under the harnesses (docker sets none: a
        # test may create a sparse file larger than the disk); the local one keeps it (host disk).
        limits = task_limits(task, replace(DEFAULT_LIMITS, max_file_mb=0)) if SANDBOXES[sandbox].builds_image else None
        make = env_factory or (lambda t, r: TerminalEnv(t, root=r, sandbox=sandbox, command_timeout_s=t.agent_timeout_s,
                                                        container=container, log_dir=task_logs, limits=limits,
                                                        keep_agent_processes=keep, network=network))
        with make(task, root) as env:
            row.network = "on" if env.allow_network else "off"
            if agent.startswith("policy:"):
                assert policy is not None
                row.passed, row.total, row.resolved, row.error = policy.episode(task, env)
                row.agent_processes = "kept" if env.keep_agent_processes else "killed"
            else:
                env.reset()
                if agent == "oracle":
                    run = env.run_solution()
                    outputs.append(("oracle", run.output))
                    if run.timed_out:
                        raise TaskError(f"the oracle timed out after {task.agent_timeout_s:g} s")
                verdict = env.verify()
                outputs.append(("tests", verdict.output))
                row.agent_processes = "kept" if env.keep_agent_processes else "killed"
                row.passed, row.total, row.resolved, row.error = verdict.passed, verdict.total, verdict.resolved, verdict.error
                if verdict.timed_out:  # scored as the harnesses score it: a failure (verifier.py)
                    outputs.append(("timeout", f"the verifier timed out after {env.verifier_timeout_s:g} s"))
                if task_logs is not None:
                    (task_logs / "verifier.txt").write_text(verdict.output)
                    if verdict.task_reward is not None:
                        (task_logs / "reward.txt").write_text(f"{verdict.task_reward:g}\n")
    except (TaskError, SandboxError) as exc:
        row.error = str(exc) or type(exc).__name__
    except Exception as exc:  # a bug or an engine failure: keep evaluating the other tasks
        row.error = f"{type(exc).__name__}: {exc}"
    if env is not None:
        why = ""
        if not env.allow_network:
            why = (f"off (--network {network}" + ("; task.toml allow_internet = false)" if env.task.layout == "tb2"
                                                  else ")"))
        row.note = failure_note(row, outputs, network=why, stopped=env.stopped_agent_processes)
    row.seconds = round(time.monotonic() - started, 3)
    if task_logs is not None:
        if row.error:
            (task_logs / "error.txt").write_text(row.error + "\n")
        (task_logs / "row.json").write_text(json.dumps(asdict(row), indent=2) + "\n")
    if row.error and len(row.error) > 2000:
        row.error = row.error[:2000] + " [...]"
    return row


def choose_sandbox(requested: str, tasks_dir: str | Path, config: Any = None) -> tuple[str, str]:
    """The backend ``t1async eval --sandbox auto`` uses, and a console line saying why ("" when
    the choice was explicit): ``local`` for task folders inside this source tree (the shipped
    ``t1async/envs/tasks``, the test fixtures), ``container`` for folders outside it where an engine is
    usable, else ``local``."""
    if requested != "auto":
        return requested, ""
    tree = Path(__file__).resolve().parents[2]  # the checkout (t1async/commands/ -> t1async/ -> the checkout)
    path = Path(tasks_dir).resolve()
    if path == tree or tree in path.parents:
        return "local", ""


    try:
        engine = resolve_engine(load_config(config).env.container if not hasattr(config, "env") else config.env.container)
    except SandboxUnavailable as exc:
        return "local", f"using the local sandbox ({exc})"
    return "container", f"using the container sandbox ({engine.name}): each task runs in an image built from its own Dockerfile"


def is_task_folder(path: str | Path) -> bool:
    """Whether ``path`` is itself one task folder (it holds ``task.toml`` or ``task.yaml``)."""
    p = Path(path)
    return (p / "task.toml").is_file() or (p / "task.yaml").is_file()


def evaluate(tasks_dir: str | Path, agent: str, *, concurrency: int = 1, sandbox: str = "local",
             config: Any = None, logs: Path | None = None, network: str = "harness",
             agent_processes: str = "keep") -> list[EvalRow]:
    """Evaluate every task folder under ``tasks_dir`` (either layout), ``concurrency`` at a time.
    ``tasks_dir`` may also be one task folder (it holds ``task.toml`` or ``task.yaml``): that task
    alone is evaluated. ``network`` and ``agent_processes``: see :func:`run_task` (the defaults are
    the harnesses'; ``config``'s ``env.network`` and ``env.keep_agent_processes`` are training's
    and do not apply here).

    Raises:
        TaskError: ``tasks_dir`` is not a folder or holds no task folder, the agent name is
            unknown, ``concurrency`` < 1, ``network`` or ``agent_processes`` is unknown, or the
            policy checkpoint cannot be loaded.
        ConfigError: ``config`` is given but missing or invalid (checked for every agent); it may
            also be a loaded :class:`~t1async.config.Config`.
        SandboxUnavailable: ``sandbox`` is unknown or cannot run here.
    """

    if agent not in ("oracle", "noop") and not (agent.startswith("policy:") and len(agent) > len("policy:")):
        raise TaskError(f"unknown agent {agent!r}: use oracle, noop or policy:CHECKPOINT")
    if concurrency < 1:
        raise TaskError(f"concurrency must be >= 1, got {concurrency}")
    if network not in NETWORK_MODES:
        raise TaskError(f"unknown network mode {network!r}: use {', '.join(NETWORK_MODES)}")
    if agent_processes not in AGENT_PROCESSES:
        raise TaskError(f"unknown agent_processes {agent_processes!r}: use keep or kill")
    if not isinstance(config, Config):
        config = load_config(config)  # a missing or invalid --config is an error even when the agent does not use it
    check_sandbox_available(sandbox)
    folders = [Path(tasks_dir).resolve()] if is_task_folder(tasks_dir) else task_folders(tasks_dir)
    if not folders or not any(is_task_folder(f) for f in folders):  # e.g. --tasks /etc: say so once, not per folder
        raise TaskError(f"no task folders under {tasks_dir} (none of its {len(folders)} folders holds task.toml or "
                        f"task.yaml); pass a folder of task folders or one task folder ({LAYOUT_HINT})")
    policy = PolicyAgent(agent.split(":", 1)[1], config) if agent.startswith("policy:") else None
    try:
        with tempfile.TemporaryDirectory(prefix="t1async-eval-") as tmp:
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                return list(pool.map(lambda f: run_task(f, agent, Path(tmp), sandbox=sandbox, policy=policy, config=config,
                                                        logs=logs, network=network, agent_processes=agent_processes),
                                     folders))
    finally:
        if policy is not None:
            policy.close()


def short_error(error: str | None, limit: int = 160) -> str:
    """An error for the table: first line, ``task /abs/path:`` prefixes and absolute task paths
    dropped, at most ``limit`` characters (the full error is in the JSON and the logs)."""
    if not error:
        return ""
    line = error.splitlines()[0]
    line = re.sub(r"task (/\S+?):\s*", "", line)
    line = re.sub(r"(/\S+/)([^/\s:]+)", lambda m: m.group(2) if m.group(1).count("/") > 3 else m.group(0), line)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def summary(rows: list[EvalRow]) -> dict[str, Any]:
    """``{"resolved_rate", "tasks", "errors", "resolved", "passed", "total"}`` over ``rows``."""
    resolved = sum(r.resolved for r in rows)
    return {
        "resolved_rate": round(resolved / len(rows), 4) if rows else 0.0,
        "tasks": len(rows),
        "errors": sum(r.error is not None for r in rows),
        "resolved": resolved,
        "passed": sum(r.passed for r in rows),
        "total": sum(r.total for r in rows),
    }


def report_json(rows: list[EvalRow], agent: str, settings: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``--out`` document: ``{"agent", "settings" (when given, e.g. ``{"network": "harness",
    "agent_processes": "keep"}``), "tasks": [row...], "summary": {...}}``."""
    doc: dict[str, Any] = {"agent": agent}
    if settings is not None:
        doc["settings"] = dict(settings)
    return {**doc, "tasks": [asdict(r) for r in rows], "summary": summary(rows)}


def format_table(rows: list[EvalRow]) -> str:
    """Fixed-width table (task, passed/total, resolved, seconds, error or note) and a summary line."""
    width = max([len("task")] + [len(r.task) for r in rows])
    lines = [f"{'task':<{width}}  tests   resolved  seconds  error"]
    for r in rows:
        lines.append(f"{r.task:<{width}}  {f'{r.passed}/{r.total}':<6}  {'yes' if r.resolved else 'no':<8}  "
                     f"{r.seconds:7.1f}  {short_error(r.error) or short_error(r.note and 'note: ' + r.note, 200)}")
    s = summary(rows)
    lines.append(f"resolved {s['resolved']}/{s['tasks']} = {s['resolved_rate']:.1%}; tests passed "
                 f"{s['passed']}/{s['total']}; errors {s['errors']}")
    return "\n".join(lines)
