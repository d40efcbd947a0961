"""Config sections of the rollout side: samplers, generation, containers, environments, rollout actors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from t1async.config.rules import Choice, Section, choice, rule, section_rule


class SamplerBackend(Choice):
    """``sampler.backend``: what serves the policy's tokens."""

    embedded = "embedded"
    """PyTorch engines in Ray actors, speaking SGLang's HTTP protocol"""
    sglang = "sglang"
    """``sglang.launch_server`` processes (started by launch, or running at ``sampler.urls``)"""


class SamplerDtype(Choice):
    """``sampler.dtype``: weights/activation dtype of the embedded engine."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class SandboxName(Choice):
    """``env.sandbox``: the sandbox backend (the keys of ``t1async.envs.sandboxes.sandbox.SANDBOXES``)."""

    local = "local"
    """bubblewrap on this machine"""
    container = "container"
    """podman/docker, the task's own Dockerfile"""
    modal = "modal"
    """Modal cloud; needs credentials"""


class Network(Choice):
    """``env.network``: network of the sandboxes."""

    task = "task"
    """Only where the task allows it (TB2 ``allow_internet``; TB1 none)"""
    harness = "harness"
    """As the benchmark's harness does (TB1 on, TB2 per ``allow_internet``)"""
    on = "on"
    """Always"""
    off = "off"
    """Never"""


class ActionFormat(Choice):
    """``env.action_format``: how the policy acts (t1async/rollout/actions.py)."""

    command = "command"
    """The assistant message is the shell command"""
    tool_call = "tool_call"
    """Qwen3 tool calls of a declared ``bash`` tool"""


class Admission(Choice):
    """``rollout.admission``: the admission rule (see ``RolloutConfig.admission``)."""

    oldest_episode = "oldest_episode"
    """Actors wait for slow episodes"""
    learner_version = "learner_version"
    """AReaL's rule: drops what gets too stale"""
    learner_wait = "learner_wait"
    """Actors run ahead, the learner waits for slow episodes"""


class Agent(Choice):
    """``rollout.agent``: who drives an episode."""

    builtin = "builtin"
    """The rollout loop"""
    external = "external"
    """``rollout.agent_command`` through the agent endpoint (Chat Completions, Responses, Messages)"""
    codex = "codex"
    """Codex CLI (``codex exec``, OpenAI Responses) inside the episode's sandbox"""
    locals()["claude-code"] = "claude-code"  # (a member's name is its value; this one has a hyphen)
    """Claude Code (``claude -p``, Anthropic Messages) inside the episode's sandbox"""
    locals()["mini-swe-agent"] = "mini-swe-agent"
    """mini-swe-agent (``mini``, OpenAI Chat Completions through litellm) inside the episode's sandbox"""
    terminus = "terminus"
    """Our Terminus-style tmux harness (keystrokes, OpenAI Chat Completions) inside the episode's sandbox"""


def agent_weights(agent: Any) -> dict[str, float]:
    """``rollout.agent`` as ``{name: weight}``: a single name is ``{name: 1.0}``, a mix is its own
    mapping (weights as floats; not normalised). The value is assumed valid (:func:`agent_value_ok`)."""
    if isinstance(agent, str):
        return {str(agent): 1.0}
    return {str(k): float(w) for k, w in agent.items()}


def agent_value_ok(agent: Any) -> bool:
    """Whether ``agent`` is a valid ``rollout.agent``: one of :class:`Agent`'s values, or a non-empty
    mapping of them to finite weights > 0."""
    if isinstance(agent, str):
        return agent in Agent.values()
    if not isinstance(agent, dict) or not agent:
        return False
    return all(k in Agent.values() and isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
               and w > 0 for k, w in agent.items())


class HistoryBreakAction(Choice):
    """``rollout.history_break``: what an external agent's broken history does."""

    split = "split"
    """Each exact segment becomes its own trajectory"""
    drop = "drop"
    """The episode is not trained"""


@dataclass
class SamplerConfig(Section):
    """Samplers: embedded PyTorch engines speaking SGLang's HTTP protocol (or SGLang servers)."""

    RULES = (
        section_rule(lambda c: not c.urls or c.backend == "sglang", "urls",
                     "empty unless sampler.backend=sglang (the embedded samplers start on this machine and would "
                     "ignore it)"),
    )

    backend: SamplerBackend = field(default=SamplerBackend.embedded, metadata=choice(SamplerBackend, "'embedded' or 'sglang'"))
    """``embedded`` (PyTorch engine in a Ray actor) or ``sglang`` (``sglang.launch_server`` processes
    started by launch, or the running servers in ``urls``; t1async/sampling/sglang_server.py). Also
    picks which distribution the learner scores tokens under, the one the backend reports (see
    ``generation.top_k``)."""
    num_samplers: int = field(default=1, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Samplers to start (M; ignored when ``urls`` is set)."""
    urls: list[str] = field(default_factory=list)
    """Base URLs of running SGLang servers to attach to (backend ``sglang`` only)."""
    host: str = "127.0.0.1"
    """Interface the embedded HTTP servers listen on."""
    dtype: SamplerDtype = field(default=SamplerDtype.float32, metadata=choice(SamplerDtype, "float32, bfloat16 or float16"))
    """Weights/activation dtype of the embedded engine: float32 or bfloat16."""
    prefix_cache: int = field(default=32, metadata=rule(lambda v: v >= 0, "an integer >= 0"))
    """Sequences whose KV cache and routing rows the embedded engine keeps for reuse by the
    next turn of the same episode (LRU; 0 = off). Keeps each position's routing row the one
    that shaped later tokens (see t1async/sampling/engine.py). Keep it >= the episodes one sampler
    serves at once, or concurrent episodes evict each other's prefixes."""
    prefill_chunk: int = field(default=0, metadata=rule(lambda v: v >= 0, "an integer >= 0"))
    """Embedded engine: feed prompts in chunks of at most this many tokens (0 = one forward)."""
    max_batch: int = field(default=64, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Embedded engine: most concurrent requests batched into one forward (continuous batching);
    more wait for a free slot."""
    request_timeout_s: float = 300.0
    """HTTP timeout of one /generate call, seconds."""
    model_path: str = ""
    """Backend ``sglang``, started servers, without ``model.path``: the Hugging Face model folder each
    server loads (its architecture must match ``model``; the learner's first publish replaces its
    weights). With ``model.path`` leave it empty: servers start from ``model.path`` (on a resume the
    newest intact checkpoint) and are checked against it; another folder here is refused."""
    tp_size: int = field(default=1, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Backend ``sglang``, started servers: GPUs (tensor-parallel ranks) per server; server i gets
    GPUs i*tp_size .. (i+1)*tp_size - 1 of the launch machine."""
    start_timeout_s: float = field(default=900.0, metadata=rule(lambda v: v > 0, "a positive number of seconds"))
    """Backend ``sglang``: most seconds to wait for every server's ``GET /health``."""
    extra_args: list[str] = field(default_factory=list)
    """Backend ``sglang``, started servers: more ``sglang.launch_server`` arguments (e.g. ``--mem-fraction-static``)."""


@dataclass
class GenerationConfig(Section):
    """Sampling parameters of one assistant turn (SGLang ``sampling_params``)."""

    max_new_tokens: int = field(default=48, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Most tokens sampled in one turn."""
    temperature: float = field(default=1.0, metadata=rule(lambda v: v >= 0, "a float >= 0 (0: greedy)"))
    """Softmax temperature; 0 means greedy (``t1async eval`` only: ``launch`` refuses it, since a
    greedy token has no density to train on; see :func:`check_trainable`)."""
    top_p: float = field(default=1.0, metadata=rule(lambda v: 0 < v <= 1, "a float in (0, 1]"))
    """Nucleus mass kept (1.0 keeps all)."""
    top_k: int = field(default=-1, metadata=rule(lambda v: v == -1 or v >= 1, "-1 (keep all) or an integer >= 1"))
    """Keep only the k most likely tokens (>= 1; -1 keeps all). The learner scores each sampled
    token as ``sampler.backend`` reports it (t1async/models/logprobs.py ``SamplingSemantics``):
    ``embedded`` renormalised over the top-k / top-p set it drew from, ``sglang`` the tempered
    softmax over the whole vocabulary (SGLang does not renormalise; it cuts top-k and top-p jointly)."""


@dataclass
class ContainerConfig(Section):
    """The ``container`` sandbox backend (``env.sandbox: container``): OCI containers built from
    each task's own Dockerfile by podman or docker (see t1async/envs/sandboxes/container.py)."""

    engine: str = "auto"
    """``podman``, ``docker``, or ``auto`` (podman if installed, else docker if its daemon answers)."""
    runtime: str = "runc"
    """podman's OCI runtime (``--runtime``); empty keeps podman's default. crun fails on hosts with
    cgroups in hybrid mode ("cgroups in hybrid mode not supported"); runc works there."""
    cgroup_manager: str = "cgroupfs"
    """podman's cgroup manager (``--cgroup-manager``): ``cgroupfs`` works without systemd;
    empty keeps podman's default."""
    ulimit_nofile: int = 1024
    """Open files per process in the container (``--ulimit nofile=N:N``), clamped to the host's
    hard limit: the engine's default asks for more than some hosts allow and fails with EPERM."""
    ulimit_nproc: int = 1000
    """RLIMIT_NPROC in the container (``--ulimit nproc=N:N``), clamped to the host's hard limit
    (the container's process cap itself is ``env.max_processes``, a pids cgroup)."""
    ca_bundle: str = "auto"
    """Host CA bundle mounted into image builds (and into containers that have network) at the
    image's /etc/ssl/certs/ca-certificates.crt, with pip and uv told to use it: needed where TLS
    is intercepted (corporate proxies, this machine). ``auto``: the host's
    /etc/ssl/certs/ca-certificates.crt (or ``SSL_CERT_FILE``) if present; a path; empty: off."""
    pass_proxy: bool = True
    """Pass the host's HTTP_PROXY/HTTPS_PROXY/NO_PROXY (either case) to builds as build args."""
    build_timeout_s: float = 1800.0
    """Bound on building one task image, seconds."""
    start_timeout_s: float = 60.0
    """Bound on creating and starting one episode's container and its shell, seconds."""
    verifier_tools: bool = True
    """Install what a task's test script would download at test time (pytest, its plugins, the
    packages it pip-installs, Debian packages it apt-installs) into a cached verifier layer at
    build time, into ``/opt/t1async-verifier`` (a venv beside the image's Python), so that tests
    run with network off; the script's own installs then become no-ops (see
    t1async/envs/taskio/adapt.py). False: the test script runs as written."""


@dataclass
class EnvConfig(Section):
    """Terminal environment: where tasks come from and how the sandboxed shell behaves."""

    tasks_dir: str = ""
    """Folder of task folders (Terminal-Bench 2 or 1 layout). Empty means the shipped t1async/envs/tasks."""
    tasks: list[str] = field(default_factory=list)
    """Names of tasks to use (empty: every task in ``tasks_dir``)."""
    sandbox: SandboxName = field(default=SandboxName.local, metadata=choice(
        SandboxName, "'local' (bubblewrap), 'container' (podman/docker, the task's own Dockerfile) or 'modal' (Modal cloud)"))
    """Sandbox backend: ``local`` (bubblewrap), ``container`` (podman/docker, the task's own
    Dockerfile; see ``env.container``) or ``modal`` (Modal cloud; needs credentials)."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """Settings of the ``container`` backend."""
    max_turns: int = field(default=4, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Assistant turns per episode before it is ended."""
    keep_agent_processes: bool = False
    """Leave the processes the agent started running while the verifier runs, as the
    Terminal-Bench and Harbor harnesses do (tasks whose tests query a server the agent started in
    the background need it, e.g. TB1 ``mlflow-register``). Off (default, for training): they are
    killed before the verifier, so nothing of the agent's can kill the tests or forge their
    output (reward hacking)."""
    network: Network = field(default=Network.task, metadata=choice(
        Network, "'task' (the task's allow_internet), 'harness' (TB1 on, TB2 allow_internet), 'on' or 'off'"))
    """Network of the sandboxes: ``task`` (default, for training): only where the task allows it
    (TB2 ``[environment] allow_internet``; TB1 tasks declare nothing, so none); ``harness``: as the
    benchmark's harness does (TB1 containers always have network, TB2 per ``allow_internet``;
    ``t1async eval`` uses this unless ``--network`` says otherwise); ``on``; ``off``."""
    max_context_tokens: int = field(default=0, metadata=rule(
        lambda v: v >= 0, "an integer >= 0 (0: model.max_position_embeddings)"))
    """Longest episode stream, tokens (0: ``model.max_position_embeddings``; a larger value is
    refused: the learner's intake refuses a longer trajectory as ``length``). Before each turn the
    rollout checks that the stream plus ``generation.max_new_tokens`` fits; when it would not, the episode ends there with
    ``finish_reason`` ``context_full`` and goes to the verifier as it stands (trained as
    ``learner.abnormal.context_full`` says), never a sampler error or a truncated prompt."""
    episode_timeout_s: float = 120.0
    """Wall-clock budget of the agent part of an episode, seconds."""
    command_timeout_s: float = 10.0
    """Per-command timeout; on expiry every process the command started is killed."""
    max_output_bytes: int = 2048
    """Longest command output shown to the model; longer output keeps head and tail around a
    visible truncation marker."""
    verifier_timeout_s: float = 0.0
    """Budget of the task's verifier (tests/test.sh), seconds; 0 uses the task's own
    ``[verifier] timeout_sec``."""
    end_signal: str = "exit"
    """An assistant message equal to this (after stripping whitespace) ends the episode."""
    run_cut_commands: bool = False
    """What to do with a turn the sampler cut at ``generation.max_new_tokens``. False (default):
    the cut command is not run (it is not the command the policy meant: half a ``rm -rf`` path,
    an unclosed heredoc) and the observation says it was cut at the token limit and not run.
    True: it is run as it is. Either way the turn is marked length-cut in the trajectory's
    ``turn_status`` (and ``learner.abnormal.length_cut`` decides how it is trained)."""
    system_prompt: str = (
        "You operate a Linux shell to finish the task. Reply with exactly one shell command per "
        "message; its output comes back as the next message. The working directory is /app. "
        "Reply with `exit` when the task is done."
    )
    """System message that opens every episode (``action_format`` command)."""
    action_format: ActionFormat = field(default=ActionFormat.command, metadata=choice(
        ActionFormat, "'command' (the message is the shell command) or 'tool_call' (Qwen3 tool calls of a bash tool)"))
    """How the policy acts (t1async/rollout/actions.py): ``command`` (the assistant message is the shell
    command) or ``tool_call`` (Qwen3 tool calls of a declared ``bash`` tool, results as
    ``<tool_response>`` turns; needs ``model.vocab_size`` >= 4100 for the tool tokens). Rollouts,
    ``t1async sft`` demonstrations and the eval ``policy:`` agent all use it."""
    tool_system_prompt: str = (
        "You operate a Linux shell to finish the task. Run exactly one shell command per message with "
        "the bash tool; its output comes back as the tool response. The working directory is /app. "
        "Reply with `exit` and no tool call when the task is done."
    )
    """System message of ``action_format`` tool_call (the tool declarations are appended to it)."""
    cpus: float = 1.0
    """Sandbox CPU share, cores, unless the task's ``[environment] cpus`` says otherwise."""
    memory_mb: int = 2048
    """Sandbox memory (processes plus files in its tmpfs folders), MiB, unless the task's
    ``[environment] memory_mb`` says otherwise; 0 = unlimited."""
    disk_mb: int = 1024
    """Size of the sandbox's /app (and /tmp, HOME, /logs each), MiB, unless the task's
    ``[environment] storage_mb`` says otherwise; 0 = unlimited."""
    max_processes: int = 256
    """Processes and threads alive at once in one sandbox (fork bombs stop here); 0 = unlimited."""
    cpu_time_s: int = 600
    """CPU seconds any one sandboxed process may use; 0 = unlimited."""
    max_file_mb: int = 512
    """Largest file a sandboxed process may write, MiB; 0 = unlimited."""
    decontam_ngram: int = 8
    """``t1async decontam``: n-gram length, in words, of the instruction/solution overlap check."""
    decontam_threshold: float = 0.2
    """``t1async decontam``: a training task whose instruction or solution shares at least this
    fraction of its n-grams with any benchmark task is flagged (and dropped with --drop)."""


@dataclass
class RolloutConfig(Section):
    """Rollout actors: each runs episodes one after another and streams trajectories."""

    RULES = (
        section_rule(lambda c: "external" not in agent_weights(c.agent) or c.agent_command.strip() != "", "agent_command",
                     "the agent program to run when rollout.agent=external (e.g. 'python tools/example_agent.py')"),
    )

    num_actors: int = field(default=2, metadata=rule(lambda v: v >= 1, "an integer >= 1 (scale live through the controller)"))
    """Rollout actors to start (N); tunable live through the controller."""
    max_restarts: int = 100
    """Crashed rollout actors the controller replaces before it gives up on the run."""
    crash_after_episodes: int = 0
    """Fault injection for tests: the first rollout actor raises after this many episodes
    (0 = off). Its replacement runs without it."""
    group_size: int = field(default=1, metadata=rule(lambda v: v >= 1, "an integer >= 1 (episodes per drawn task)"))
    """Episodes of each drawn task admitted back to back (G), so the learner can compare them
    (``learner.advantage: group``, as GRPO and RLOO sample G completions per prompt)."""
    admission: Admission = field(default=Admission.learner_wait, metadata=choice(
        Admission, "'oldest_episode' (actors wait for slow episodes), 'learner_version' (AReaL's rule: drops what gets too"
        " stale) or 'learner_wait' (actors run ahead, the learner waits for slow episodes)"))
    """Admission rule (t1async/rollout/admission.py), each keeping every trajectory trained within
    ``learner.max_staleness`` versions of its sampling: ``learner_wait`` (default) lets a rollout
    start while ``started < (v + max_staleness + 1) x batch_size x publish_every`` with ``v`` the
    learner's version (AReaL's rule), and the learner trains oldest first and waits for a slow
    episode before publishing a version it could not be trained at (no stale drops; the actors
    keep sampling meanwhile); ``oldest_episode`` takes ``v`` from the oldest episode not yet
    trained, so the actors wait with a slow episode instead (no drops, slower: ``t1async bench
    async``); ``learner_version`` is AReaL's rule alone: the fast run ahead and the learner drops
    a slow episode that became too stale (fastest; slow tasks are trained less often than they
    are started). With ``learner.max_staleness=0`` every rule is synchronous RL."""
    agent: Any = field(default="builtin", metadata=rule(
        agent_value_ok, "'builtin' (the rollout loop), 'external' (rollout.agent_command through the agent endpoint), "
                        "'codex', 'claude-code', 'mini-swe-agent' or 'terminus' (those agents inside the "
                        "sandbox), or a mix of them drawn per episode, each with a weight > 0, e.g. {builtin: 2, codex: 1}"))
    """Who drives an episode (:class:`Agent`): ``builtin`` (the rollout loop of t1async/rollout/episode.py) or
    ``external`` (the program ``agent_command``, talking OpenAI Chat Completions, OpenAI Responses or Anthropic
    Messages, streamed or not, to the agent endpoint that records every completion token-exactly;
    t1async/rollout/endpoint/, t1async/rollout/endpoint/agent.py), or a named harness run inside the episode's
    sandbox against that endpoint: ``codex`` (``codex exec``), ``claude-code`` (``claude -p``),
    ``mini-swe-agent`` (``mini``) or ``terminus`` (keystrokes into tmux, t1async/rollout/terminus.py);
    t1async/rollout/harnesses.py. A mapping of names to weights mixes them:
    each episode draws its agent with probability weight / sum of weights (seeded by ``run.seed`` and the
    rollout actor's number: reproducible), records it in the trajectory (``agent``) and metrics.jsonl
    splits its rows by it (``by_agent``). Agents other than builtin need
    ``model.vocab_size`` >= 4100 (tool calls use the tool-call special ids)."""
    agent_command: str = ""
    """``rollout.agent: external``: the agent program, split like a shell line (a first word
    ``python`` is the rollout actor's own Python). It starts once per episode with ``OPENAI_BASE_URL``,
    ``OPENAI_API_KEY``, ``T1ASYNC_SANDBOX_URL``, ``T1ASYNC_INSTRUCTION`` and ``T1ASYNC_MAX_TURNS``
    set, e.g. ``python tools/example_agent.py``."""
    agent_cwd: str = ""
    """Working folder of the agent program (empty: the folder ``t1async launch`` ran in)."""
    history_break: HistoryBreakAction = field(default=HistoryBreakAction.split, metadata=choice(
        HistoryBreakAction, "'split' (exact segments) or 'drop' (the episode)"))
    """An agent on the endpoint (``rollout.agent: external`` or a named harness), when it re-sends a
    history that does not continue the previous completion (edited, truncated, re-ordered): ``split``
    (each exact segment becomes its own trajectory with the episode's reward; earlier segments end with ``finish_reason``
    ``history_break``) or ``drop`` (the episode is not trained; counted as a failed episode
    ``HistoryBreak``). Never re-tokenized either way."""
