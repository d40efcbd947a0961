"""Typed configuration: one dataclass per component, defaults in code, YAML only overrides.

A config file (``configs/*.yaml``) and ``key=value`` overrides on the command line are merged
onto :class:`Config` with OmegaConf's structured-config mode, so an unknown key or a value of
the wrong type is refused with :class:`ConfigError` naming the key and where it came from.
Each component receives only its own section (``cfg.learner`` for the learner, and so on).

Source of the merge semantics: OmegaConf 2.x structured configs
(https://omegaconf.readthedocs.io/en/latest/structured_config.html).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional



ADVANTAGE_NAMES = ("gae", "group", "grpo")
"""Values of ``learner.advantage``: the keys of ``t1async.learner.advantages.ADVANTAGES``."""
POLICY_LOSS_NAMES = ("ppo",)
"""Values of ``learner.policy_loss``: the keys of ``t1async.learner.losses.POLICY_LOSSES``."""


class ConfigError(ValueError):
    """A config file is missing, unreadable, or holds an unknown key or a wrongly typed value."""


@dataclass
class RunConfig:
    """Where the run writes and how it is seeded."""

    dir: str = "runs/{now}"
    """Run directory (log, metrics.jsonl, checkpoints, resolved config). ``{now}`` is replaced
    by a UTC timestamp ``YYYYmmdd-HHMMSS`` at launch."""
    seed: int = 0
    """Seed for the learner's model init and every sampler's RNG (sampler i uses seed + i)."""
    torch_threads: int = 1
    """Intra-op threads each actor process gives torch (keep actors x threads <= cores)."""
    overwrite: bool = False
    """Start over in a ``dir`` that holds an earlier run (its metrics, checkpoints, logs, receive
    log and spool are deleted first). Off: such a launch is refused unless ``learner.resume``."""
    log_rotation: str = "50 MB"
    """Each role's log (``logs/NAME.log``) is rotated at this size (loguru ``rotation``)."""
    log_retention: int = 3
    """Rotated files kept per role log (loguru ``retention``, a count)."""
    tensorboard: bool = True
    """Write each learner step's scalars as TensorBoard events to ``tensorboard/`` (tensorboardX)."""
    audit: bool = False
    """Record the id of every trajectory the rollout actors spooled in ``RUN_DIR/audit/`` (one line
    each; ``t1async soak`` turns it into its ledger). Grows with the run: for soaks, not services."""
    learner_restarts: int = 3
    """Restarts in a row of a learner that died (from its last checkpoint and the receive log, as
    ``learner.resume`` does); a learner that trained a step before dying starts a new row. Restarts
    in a row wait 5, 10, 20, 40, 60, 60 ... s (back-off); beyond this many the run stops with one
    line saying how to resume (0: never restart)."""
    sampler_restarts: int = 3
    """Restarts in a row of an embedded sampler that died (its Ray actor died, it failed three
    health checks in a row, or a weight update took it out of service), with the learner's
    back-off (5, 10, 20 ... 60 s); one that served a request before dying starts a new row. Beyond
    this many in a row it is left ``failed`` in ``t1async status`` (0: never restart)."""


@dataclass
class RayConfig:
    """How ``launch`` reaches Ray."""

    address: Optional[str] = None
    """Address of an existing Ray cluster (``auto`` or ``host:port``); None starts a local one."""
    num_cpus: Optional[int] = None
    """CPUs a locally started Ray advertises; None lets Ray count them."""


@dataclass
class ModelConfig:
    """Policy architecture: Qwen3-MoE, with Hugging Face ``Qwen3MoeConfig`` field names.

    Written verbatim (plus ``architectures`` and ``model_type``) as a checkpoint's config.json.
    """

    vocab_size: int = 4096
    """Rows of the embedding and of the LM head; must be >= the tokenizer's vocabulary."""
    hidden_size: int = 128
    """Residual stream width."""
    num_hidden_layers: int = 4
    """Decoder layers; every layer is an MoE layer (``decoder_sparse_step`` = 1)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_attention_heads``."""
    head_dim: int = 32
    """Width of one attention head."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 256
    """Hidden width of one expert's SwiGLU MLP."""
    norm_topk_prob: bool = True
    """Renormalise the top-k gate probabilities to sum to 1 (Qwen3-MoE default)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    max_position_embeddings: int = 8192
    """Longest sequence (tokens) the model is configured for."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the LM head."""
    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights."""


@dataclass
class SamplerConfig:
    """Samplers: embedded PyTorch engines speaking SGLang's HTTP protocol (or SGLang servers)."""

    backend: str = "embedded"
    """``embedded`` (PyTorch engine in a Ray actor) or ``sglang`` (``sglang.launch_server`` processes
    started by launch, or the running servers in ``urls``; t1async/sampling/sglang_server.py)."""
    num_samplers: int = 1
    """Samplers to start (M; ignored when ``urls`` is set)."""
    urls: list[str] = field(default_factory=list)
    """Base URLs of running SGLang servers to attach to (backend ``sglang`` only)."""
    host: str = "127.0.0.1"
    """Interface the embedded HTTP servers listen on."""
    dtype: str = "float32"
    """Weights/activation dtype of the embedded engine: float32 or bfloat16."""
    prefix_cache: int = 32
    """Sequences whose KV cache and routing rows the embedded engine keeps for reuse by the
    next turn of the same episode (LRU; 0 = off). Keeps each position's routing row the one
    that shaped later tokens (see t1async/sampling/engine.py). Keep it >= the episodes one sampler
    serves at once, or concurrent episodes evict each other's prefixes."""
    prefill_chunk: int = 0
    """Embedded engine: feed prompts in chunks of at most this many tokens (0 = one forward)."""
    max_batch: int = 64
    """Embedded engine: most concurrent requests batched into one forward (continuous batching);
    more wait for a free slot."""
    request_timeout_s: float = 300.0
    """HTTP timeout of one /generate call, seconds."""
    model_path: str = ""
    """Backend ``sglang``, started servers: the Hugging Face model folder each server loads (its
    architecture must match ``model``; the learner's first publish replaces its weights)."""
    tp_size: int = 1
    """Backend ``sglang``, started servers: GPUs (tensor-parallel ranks) per server; server i gets
    GPUs i*tp_size .. (i+1)*tp_size - 1 of the launch machine."""
    start_timeout_s: float = 900.0
    """Backend ``sglang``: most seconds to wait for every server's ``GET /health``."""
    extra_args: list[str] = field(default_factory=list)
    """Backend ``sglang``, started servers: more ``sglang.launch_server`` arguments (e.g. ``--mem-fraction-static``)."""


@dataclass
class GenerationConfig:
    """Sampling parameters of one assistant turn (SGLang ``sampling_params``)."""

    max_new_tokens: int = 48
    """Most tokens sampled in one turn."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (``t1async eval`` only: ``launch`` refuses it, since a
    greedy token has no density to train on; see :func:`check_trainable`)."""
    top_p: float = 1.0
    """Nucleus mass kept (1.0 keeps all)."""
    top_k: int = -1
    """Keep only the k most likely tokens (>= 1; -1 keeps all). The sampler reports, and the
    learner scores, log-probs of this processed distribution (t1async.models.logprobs.processed_logprobs)."""


@dataclass
class ContainerConfig:
    """The ``container`` sandbox backend (``env.sandbox: container``): OCI containers built from
    each task's own Dockerfile by podman or docker (see t1async/envs/container.py)."""

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
    t1async/envs/adapt.py). False: the test script runs as written."""


@dataclass
class EnvConfig:
    """Terminal environment: where tasks come from and how the sandboxed shell behaves."""

    tasks_dir: str = ""
    """Folder of task folders (Terminal-Bench 2 or 1 layout). Empty means the shipped envs/tasks."""
    tasks: list[str] = field(default_factory=list)
    """Names of tasks to use (empty: every task in ``tasks_dir``)."""
    sandbox: str = "local"
    """Sandbox backend: ``local`` (bubblewrap), ``container`` (podman/docker, the task's own
    Dockerfile; see ``env.container``) or ``modal`` (Modal cloud; needs credentials)."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """Settings of the ``container`` backend."""
    max_turns: int = 4
    """Assistant turns per episode before it is ended."""
    keep_agent_processes: bool = False
    """Leave the processes the agent started running while the verifier runs, as the
    Terminal-Bench and Harbor harnesses do (tasks whose tests query a server the agent started in
    the background need it, e.g. TB1 ``mlflow-register``). Off (default, for training): they are
    killed before the verifier, so nothing of the agent's can kill the tests or forge their
    output (reward hacking)."""
    network: str = "task"
    """Network of the sandboxes: ``task`` (default, for training): only where the task allows it
    (TB2 ``[environment] allow_internet``; TB1 tasks declare nothing, so none); ``harness``: as the
    benchmark's harness does (TB1 containers always have network, TB2 per ``allow_internet``;
    ``t1async eval`` uses this unless ``--network`` says otherwise); ``on``; ``off``."""
    max_context_tokens: int = 0
    """Longest episode stream, tokens (0: ``model.max_position_embeddings``; a larger value is
    capped at it). Before each turn the rollout checks that the stream plus
    ``generation.max_new_tokens`` fits; when it would not, the episode ends there with
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
    action_format: str = "command"
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
class RolloutConfig:
    """Rollout actors: each runs episodes one after another and streams trajectories."""

    num_actors: int = 2
    """Rollout actors to start (N); tunable live through the controller."""
    max_restarts: int = 100
    """Crashed rollout actors the controller replaces before it gives up on the run."""
    crash_after_episodes: int = 0
    """Fault injection for tests: the first rollout actor raises after this many episodes
    (0 = off). Its replacement runs without it."""
    group_size: int = 1
    """Episodes of each drawn task admitted back to back (G), so the learner can compare them
    (``learner.advantage: group``, as GRPO and RLOO sample G completions per prompt)."""
    admission: str = "learner_wait"
    """Admission rule (actors/controller.py), each keeping every trajectory trained within
    ``learner.max_staleness`` versions of its sampling: ``learner_wait`` (default) lets a rollout
    start while ``started < (v + max_staleness + 1) x batch_size x publish_every`` with ``v`` the
    learner's version (AReaL's rule), and the learner trains oldest first and waits for a slow
    episode before publishing a version it could not be trained at (no stale drops; the actors
    keep sampling meanwhile); ``oldest_episode`` takes ``v`` from the oldest episode not yet
    trained, so the actors wait with a slow episode instead (no drops, slower: ``t1async bench
    async``); ``learner_version`` is AReaL's rule alone: the fast run ahead and the learner drops
    a slow episode that became too stale (fastest; slow tasks are trained less often than they
    are started). With ``learner.max_staleness=0`` every rule is synchronous RL."""
    agent: str = "builtin"
    """Who drives an episode: ``builtin`` (the rollout loop of t1async/rollout/episode.py) or ``external``
    (the program ``agent_command``, talking to an OpenAI-compatible endpoint that records every
    completion token-exactly; t1async/rollout/openai_endpoint.py, t1async/rollout/agent.py). Needs
    ``model.vocab_size`` >= 4100 (tool calls use the tool-call special ids)."""
    agent_command: str = ""
    """``rollout.agent: external``: the agent program, split like a shell line (a first word
    ``python`` is the rollout actor's own Python). It starts once per episode with ``OPENAI_BASE_URL``,
    ``OPENAI_API_KEY``, ``T1ASYNC_SANDBOX_URL``, ``T1ASYNC_INSTRUCTION`` and ``T1ASYNC_MAX_TURNS``
    set, e.g. ``python tools/example_agent.py``."""
    agent_cwd: str = ""
    """Working folder of the agent program (empty: the folder ``t1async launch`` ran in)."""
    history_break: str = "split"
    """``rollout.agent: external``, when the agent re-sends a history that does not continue the
    previous completion (edited, truncated, re-ordered): ``split`` (each exact segment becomes its
    own trajectory with the episode's reward; earlier segments end with ``finish_reason``
    ``history_break``) or ``drop`` (the episode is not trained; counted as a failed episode
    ``HistoryBreak``). Never re-tokenized either way."""


@dataclass
class TransportConfig:
    """Trajectory transport: ZeroMQ DEALER (rollout actors) -> ROUTER (learner), acknowledged.

    Delivery is at least once, de-duplicated by trajectory id (see t1async/transport/transport.py): an actor
    spools each trajectory to disk, sends it, and frees its file (for reuse) when the learner
    acknowledges it after appending it to its durable receive log (RUN_DIR/receive_log).
    """

    scheme: str = "tcp"
    """``tcp`` (between machines) or ``ipc`` (one machine)."""
    host: str = "127.0.0.1"
    """Interface the learner binds (tcp) and actors connect to."""
    port: int = 0
    """TCP port the learner binds; 0 picks a free one."""
    rcvhwm: int = 64
    """Learner ZeroMQ receive high-water mark, messages (ZeroMQ counts messages, not bytes; the
    byte bound is ``window_bytes`` per actor and ``recv_queue_bytes``)."""
    sndhwm: int = 8
    """Rollout actor ZeroMQ send high-water mark, messages."""
    recv_queue_messages: int = 0
    """Decoded trajectories the learner holds in memory waiting for a batch (0: 4 x batch size,
    at least 8). When full, the learner stops reading the socket (backpressure)."""
    recv_queue_bytes: int = 2 << 30
    """Bytes of decoded trajectories the learner holds in memory (one larger trajectory is still
    admitted into an empty queue)."""
    window_messages: int = 64
    """Trajectories one actor has sent and not yet had acknowledged (in flight)."""
    window_bytes: int = 256 << 20
    """Bytes one actor has in flight; more waits in its on-disk spool."""
    spool_dir: str = ""
    """Folder of the actors' on-disk spools of unacknowledged trajectories. Empty: launch uses
    RUN_DIR/spool; an actor built without one uses a private temporary folder. A new actor
    adopts (and resends) the spool of an actor that died."""
    spool_max_bytes: int = 4 << 30
    """Bytes one actor may keep spooled; ``send`` waits (backpressure) while the spool is fuller."""
    spool_max_messages: int = 256
    """Trajectories one actor may keep spooled; ``send`` waits while the spool holds more."""
    send_timeout_s: float = 3600.0
    """Longest ``send`` waits for spool room before it raises TransportError."""
    ack_timeout_s: float = 300.0
    """Resend a trajectory not acknowledged this long after it was sent (reconnects resend at once)."""
    log_fsync: str = "always"
    """Receive-log durability before an acknowledgement: ``always`` (fsync each record: survives
    power loss) or ``never`` (page cache: survives a learner crash or SIGKILL, not the machine)."""
    log_group_messages: int = 64
    """Most deliveries already waiting on the socket that the learner stores with one flush of
    the receive log before it ACKs any of them (group commit); 1: a flush per trajectory."""
    max_message_bytes: int = 4 << 30
    """Largest trajectory frame the learner accepts (ZeroMQ drops the peer's connection beyond)."""
    curve: bool = False
    """Authenticate and encrypt with CurveZMQ; keys come from ``keys_dir``."""
    keys_dir: str = ""
    """Folder written by ``t1async keys DIR``: learner.key(_secret), rollout.key(_secret) and
    authorized/ (public keys of the actors the learner accepts)."""


@dataclass
class WeightSyncConfig:
    """How the learner hands its weights to every sampler (t1async/weights/)."""

    mode: str = "distributed"
    """``distributed``: SGLang's ``/update_weights_from_distributed``, the learner broadcasts each
    bucket over a torch.distributed group it forms with the samplers (samplers anywhere; on GPUs one
    rank per GPU). ``tensor``: SGLang's ``/update_weights_from_tensor``, for samplers on the
    learner's machine, including its own GPU (where NCCL refuses a second rank): each bucket goes
    as handles to the learner's memory, CUDA IPC on GPU or named shared memory on CPU, and the
    sampler copies it during the request; no group is formed, so ``backend``, ``master_address``
    and ``master_port`` are unused. Launch refuses ``tensor`` with ``sampler.urls`` on another host."""
    backend: str = "gloo"
    """torch.distributed backend of ``mode: distributed``: ``gloo`` (CPU) or ``nccl`` (GPUs)."""
    master_address: str = "127.0.0.1"
    """Address of the learner's rendezvous TCPStore."""
    master_port: int = 0
    """Port of the rendezvous TCPStore; 0 picks a free one."""
    timeout_s: float = 120.0
    """Timeout of the group's rendezvous, of each broadcast and of each weight-sync HTTP call
    (in ``tensor`` mode: of each call, the receiver's copy of a bucket included), seconds. Both
    ends for embedded samplers (the learner sends it when the group is formed); an SGLang server
    keeps torch's 30-minute group timeout, so the learner stops waiting after this
    long and takes that server out of service (left paused, never serving partial weights)."""
    bucket_mb: float = 512.0
    """Most MiB sent at once (distributed: SGLang ``load_format: flattened_bucket``, one uint8
    tensor per bucket; tensor: one ``/update_weights_from_tensor`` call per bucket); non-expert
    parameters first, then experts. Each bucket is allocated once more on both ends while it is in
    flight (tensor mode: on the learner's side only when its parameters are not packed)."""
    pause_mode: str = "abort"
    """``/pause_generation`` mode during an update. Only ``abort``: running requests end and the
    client sends them again after the update (the pinned SGLang reports no per-token weight
    versions, so ``retract``/``in_place`` would label tokens of two versions with one)."""


@dataclass
class AbnormalConfig:
    """What the learner does with a trajectory that did not end normally, one field per kind.

    Each kind is recorded by the rollout actor: per turn in ``Trajectory.turn_status``, per
    episode in ``finish_reason``. Values: ``train`` (as if nothing happened: the outcome is a
    consequence of the policy's own choice and the reward is real), ``mask_turn`` (per-turn kinds
    only: the sampled tokens of each such turn leave the policy loss; the critic still trains on
    them, see actors/learner.py), ``drop`` (the whole trajectory is never trained on: its
    admission slot is returned, its id marked consumed, and it is counted by kind in
    metrics.jsonl ``dropped``). A trajectory whose every loss token is masked is dropped
    (``dropped["all_turns_masked"]``).

    A verifier error (``Trajectory.verifier_error`` set: timeout, crash, no test summary) is
    always dropped and not configurable: its reward is unknown, the 0 it carries is not a real
    score, and since the reward reaches every token through GAE there is no part of the episode
    that could be trained safely (``dropped["verifier_error"]``).
    """

    length_cut: str = "train"
    """A turn cut at ``generation.max_new_tokens`` (run or not, see ``env.run_cut_commands``).
    Default train: the policy sampled every one of those tokens itself, and running out of tokens
    (with the observation saying so) is what teaches it to answer briefly."""
    aborted: str = "drop"
    """A turn the sampler aborted (SGLang finish_reason ``abort``; the command was not run).
    Default drop: the turn was ended by the serving system, not by the policy, so the rest of the
    episode and its reward are shaped by an event the policy cannot learn to avoid."""
    command_timeout: str = "train"
    """A turn whose command overran ``env.command_timeout_s`` and was killed. Default train: a
    hanging command is the policy's choice, and the timeout note it saw is its consequence."""
    sandbox_refused: str = "train"
    """A turn whose command hit a sandbox limit (processes, memory, disk). Default train: as for a
    timeout, the limit is part of the environment the policy acts in."""
    tool_call_error: str = "train"
    """A turn whose tool call was malformed (``env.action_format`` tool_call; it was not run and
    the agent saw an error observation). Default train: the malformed call is the policy's own
    output and the error it saw is its consequence."""
    context_full: str = "train"
    """An episode ended because the next turn would not fit the context (``env.max_context_tokens``,
    default the model's; ``train`` or ``drop``). Default train: the verifier judged the final
    state, so the reward is real."""
    episode_timeout: str = "train"
    """An episode ended because the agent's time budget was spent (finish_reason ``timeout``;
    ``train`` or ``drop``). Default train: the reward of the state reached in time is real."""


@dataclass
class MegatronConfig:
    """``learner.backend: megatron``: megatron-core's GPTModel (t1async/learner/megatron/backend.py)."""

    tensor_parallel: int = 1
    """Tensor-parallel size T (must divide the attention heads, key/value heads, vocabulary and
    ``moe_intermediate_size``). T > 1 splits attention, vocabulary and every expert's MLP over T
    ranks with sequence parallelism (megatron-core requires it for MoE with tensor parallelism);
    with ``expert_parallel`` P the backend runs T x P ranks: P data-parallel groups of T, rank 0
    in the learner and the rest as Ray actors. Sequences are right-padded to a multiple of T."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size S (must divide ``model.num_hidden_layers``; not with
    ``model.tie_word_embeddings``). S > 1 puts L/S consecutive layers on each of S stages (the
    embedding on the first, the final norm and head on the last), T x S x P ranks in all; a
    micro-batch's hidden states pass from stage to stage in the forward and their gradients back
    in the backward, one micro-batch at a time (no overlap of stages: it shards layers and their
    optimiser state, it does not run stages in parallel)."""
    expert_parallel: int = 1
    """Expert-parallel size N (must divide ``model.num_experts``). N > 1: the learner's backend
    is rank 0 and starts the other ranks as Ray actors (one GPU each on CUDA, no CPU reservation
    on CPU); each expert-parallel rank (with its ``tensor_parallel`` ranks) holds E/N experts of
    every MoE layer and forwards ceil(B/N) of the rows of each ``[B, T]`` micro-batch (the last
    chunks filled up with dummy rows: with ``learner.micro_batch_tokens`` 0, B = 1 and only rank
    0 does useful work); rank 0 gathers the outputs, so metrics and the learner's loss are the
    same as with one process (shared gradients summed over ranks; t1async/learner/megatron/backend.py,
    t1async/learner/megatron/ranks.py)."""
    distributed_optimizer: bool = True
    """With P = ``expert_parallel`` > 1: the weights every data-parallel rank holds (all but the
    experts) keep their float32 masters and AdamW moments sharded, 1/P per rank (ZeRO stage 1, as
    megatron-core's distributed optimizer does): each rank steps its shard and the updated weights
    are all-gathered. The same updates bit for bit (AdamW is elementwise); 12 bytes per replicated
    weight become 12/P. Off: every rank keeps them all."""
    timeout_s: float = 300.0
    """Seconds rank 0 waits for its other ranks (tensor, pipeline, expert parallel) in a
    collective before failing with an error (a dead rank is named at once); Megatron's own groups
    round it down to whole minutes (at least one), and the ranks' start-up gets at least 120 s."""
    dispatcher: str = "auto"
    """MoE token dispatcher: ``allgather``, ``alltoall`` (CUDA only) or ``auto`` (alltoall on
    CUDA, allgather on CPU)."""
    dtype: str = "float32"
    """Parameter and compute dtype: float32 or bfloat16 (router and value head stay float32). With
    bfloat16, AdamW steps float32 master copies of the weights and rounds them into the model
    (t1async.learner.backend.MasterWeightAdamW): stepped in bfloat16 directly, nearly every update at RL
    learning rates would round away."""
    device: str = "auto"
    """``cpu``, ``cuda`` (the current CUDA device), ``cuda:K`` or ``auto`` (cuda when available).
    With ``expert_parallel`` > 1 this is rank 0's; the other ranks get one GPU each from Ray."""


@dataclass
class LearnerConfig:
    """Actor-critic learner: decoupled PPO with truncated importance weights and GAE."""

    max_steps: int = 8
    """Learner steps after which the run stops; 0 = run until stopped (``t1async stop RUN_DIR``,
    Ctrl-C, SIGTERM or SIGHUP). Changeable live (``t1async scale``)."""
    batch_size: int = 4
    """Trajectories per learner step; admission control lets ``batch_size x publish_every``
    rollouts start per published weight version."""
    max_staleness: int = 1
    """Largest allowed (learner version - oldest token version) of a trajectory trained on."""
    publish_every: int = 1
    """Publish new weights to every sampler after this many learner steps (K)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (0: only the final one)."""
    keep_checkpoints: int = 2
    """Checkpoints kept after each new one: the newest this many (>= 1), plus those of
    ``keep_every``; the others are deleted (a default checkpoint is about 95 MB: policy, critic and
    both AdamW states)."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this, for history (0 = none)."""
    episodes_per_step: int = 2
    """Episodes of each step's batch written as a readable transcript to
    ``RUN_DIR/episodes/step_NNNNNN.md`` (instruction, each command and its output, the verifier's
    verdict; 0 = none). The newest 200 files are kept."""
    lr: float = 1e-4
    """AdamW learning rate of the policy."""
    lr_warmup_steps: int = 0
    """Policy updates over which the learning rate ramps linearly up to ``lr`` (counted from the
    first policy update, after critic warm-up; 0 = none)."""
    critic_lr: float = 1e-4
    """AdamW learning rate of the critic."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    ppo_epochs: int = 1
    """Optimisation passes over each batch."""
    clip_eps: float = 0.2
    """PPO ratio clip epsilon (ratio against the proximal policy)."""
    is_cap: float = 2.0
    """Cap C of the truncated behaviour importance weight min(pi_prox / mu, C)."""
    value_clip: float = 0.2
    """Clip range of the value loss around the old values."""
    value_coef: float = 0.5
    """Weight of the value loss."""
    gamma: float = 1.0
    """GAE discount over sampled tokens."""
    lam: float = 0.95
    """GAE lambda."""
    normalize_advantages: bool = True
    """Whiten advantages over the batch's loss tokens (mean 0, std 1)."""
    policy_loss: str = "ppo"
    """The policy's loss: ``ppo`` (decoupled PPO with a truncated behaviour importance weight,
    the proximal policy in the ratio's denominator; :func:`t1async.learner.rl.policy_loss`).
    The losses are registered in t1async/learner/losses.py."""
    advantage: str = "gae"
    """How each sampled token's advantage is estimated: ``gae`` (the critic, GAE over sampled
    tokens), ``group`` (leave-one-out: the episode's reward less the mean reward of the other
    episodes of its task, the same for every token; :func:`t1async.learner.rl.group_baselines`; with
    ``rollout.group_size`` > 1 so each task's episodes come in groups) or ``grpo`` (GRPO: the
    episode's reward less its group's mean, divided by the group's standard deviation;
    :func:`t1async.learner.advantages.group_normalized`). Under ``group`` and ``grpo`` a trajectory
    with no peer of its task falls back to GAE; ``group_baselined_frac`` in metrics.jsonl is the
    share that had one. The critic trains either way unless ``critic`` is off. The estimators are
    registered in t1async/learner/advantages.py."""
    group_window_steps: int = 2
    """``advantage: group`` or ``grpo``: peers trained up to this many steps before the current one count too
    (members of a group that landed in an earlier batch)."""
    critic: bool = True
    """Run and train the critic. ``advantage: group`` needs it only for trajectories without a
    peer of their task; off, those take the mean reward of the rest of the batch as baseline
    (REINFORCE's batch baseline), no critic is built (no weights, optimiser state or
    ``critic.safetensors``: one model fewer in memory) and each step skips the critic's forward,
    backward and optimiser step (the critic is a copy of the policy's trunk, so these cost about
    what the policy's do).
    Off requires ``advantage: group`` and ``critic_warmup_steps: 0``; ``value_loss`` and
    ``explained_variance`` are then absent from metrics.jsonl."""
    negative_advantage_weight: float = 1.0
    """Multiplier of negative advantages, after whitening when ``normalize_advantages`` (0..1).
    1: the usual policy gradient. Below 1 the update leans toward what did better than the
    baseline: with group advantages and whitening off, 0 trains only on the episodes above their
    baseline; with whitening on, only on tokens above the batch's mean advantage (reward-filtered imitation of the policy's own better episodes, RAFT++ in
    Xiong et al. 2025, "A Minimalist Approach to LLM Reasoning"; Arnal et al. 2025, "Asymmetric
    REINFORCE", show why a baseline below the mean is the stable side off-policy): pushing
    failed episodes' tokens down has no floor. Measured once here it did not help: at lr 1e-3 with
    weight 0 the policy drifted within 3 minutes (README, "Warm start and learning")."""
    critic_warmup_steps: int = 0
    """Initial steps that train only the critic, on rollouts of the starting (warm-started)
    policy, before the first policy update (``phase`` is ``critic_warmup`` in metrics.jsonl)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the reference policy (the warm start ``init_checkpoint``, frozen;
    the initial weights without one): ``kl_coef x`` the per-token k3 estimate of
    KL(pi_theta || pi_ref) (Schulman 2020), averaged over loss tokens, is added to the policy loss
    (as InstructGPT, Ouyang et al. 2022, anchors PPO). It keeps behaviour the reward does not see
    (ending with the end signal, the shape of commands) from drifting. 0 = off (no reference is
    kept). Reported as ``kl_ref``."""
    reward: str = "dense"
    """Episode reward: ``dense`` (the number of verifier tests passed, the reference's choice) or
    ``binary`` (1 when resolved, else 0)."""
    routing_replay: bool = True
    """Replay the sampler's routed experts in every MoE layer (R3)."""
    init_checkpoint: str = ""
    """Folder with model.safetensors + config.json to warm-start the policy from ('' = random init)."""
    dump_trajectories: int = 0
    """Write the first N received trajectory frames to RUN_DIR/trajectories/ (``ID.traj``; read
    them with ``t1async.trajectory.decode``) for inspection."""
    batch_timeout_s: float = 600.0
    """Longest wait for one batch before the learner reports it is starved and stops; under
    ``rollout.admission: learner_wait`` also the longest it holds a publish for a slow episode
    (it then publishes anyway, logged, and drops what that makes too stale)."""
    micro_batch_tokens: int = 4096
    """Trajectories trained in one padded forward and backward, up to this many positions
    (sequences x the longest, :func:`t1async.learner.rl.micro_batches`; longest first). Results equal
    one forward per trajectory up to float summation order (tests/test_learner.py); fewer,
    larger matmuls are faster (``t1async bench micro-batch``). 0 = one trajectory per micro-batch."""
    max_tokens_per_chunk: int = 4096
    """A micro-batch whose sequences are longer than this many positions (a long episode, alone in
    its micro-batch at the default ``micro_batch_tokens``) is trained in chunks, so a long episode
    (100k tokens and more) fits in memory: the LM head and its log-probs run this many positions at
    a time and every decoder layer is activation-checkpointed (recomputed in the backward). On
    both backends; the ``megatron`` one recomputes each layer with the experts its forward used
    (replayed, or the router's own, checked: t1async/learner/megatron/model.py ``LayerRecompute``).
    Log-probs, values and routing are those of one plain forward, gradients equal up to float
    summation order (tests/test_long_horizon.py, tests/test_megatron.py). Each step's metrics count
    the micro-batches trained so (``chunked_micro_batches``). Memory and time on the episode of
    ``t1async bench long-horizon``: README "Long episodes". Shorter micro-batches take the plain
    forward, unchanged. 0 = never chunk."""
    abnormal: AbnormalConfig = field(default_factory=AbnormalConfig)
    """What to train of episodes and turns that did not end normally (see :class:`AbnormalConfig`)."""
    backend: str = "torch"
    """Training engine: ``torch`` (plain PyTorch, t1async/models/model.py; the CPU default) or
    ``megatron`` (megatron-core GPTModel, ``pip install 't1async[megatron]'``). Checkpoints are
    Hugging Face safetensors either way, so a resumed run may switch."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Settings of the ``megatron`` backend."""
    resume: bool = False
    """Resume in ``run.dir`` (give the killed run's directory): restore the latest checkpoint
    (weights, optimisers, step, version, the ids it consumed), then train on every trajectory in
    the receive log that checkpoint had not consumed. No checkpoint: start at step 0 and replay
    the whole log. Off: a receive log left in ``run.dir`` is discarded."""


@dataclass
class MismatchConfig:
    """``t1async mismatch``: training-vs-inference mismatch of one set of rollouts (t1async/commands/mismatch.py)."""

    episodes: int = 8
    """Episodes to roll out (tasks taken in turn from ``env.tasks`` or every shipped task)."""
    learner_dtype: str = "float32"
    """dtype of the learner-side model that re-scores the rollouts: float32 or bfloat16."""
    init_checkpoint: str = ""
    """Folder with model.safetensors + config.json for the policy ('' = random init, seeded)."""
    pretrain_steps: int = 0
    """Train the policy this many steps on text (the shipped tasks rendered as episodes, plus
    Python standard-library sources) before the rollouts, so that its experts specialise."""
    pretrain_seq_len: int = 128
    """Tokens per pretraining window."""
    pretrain_batch: int = 8
    """Windows per pretraining step."""
    pretrain_lr: float = 2e-3
    """AdamW learning rate of the pretraining."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss during pretraining (Switch Transformer's
    ``E * sum_e f_e * P_e``, Fedus et al. 2021), which keeps every expert in use."""
    save_checkpoint: str = ""
    """Write the (pretrained) policy here before the rollouts ('' = do not)."""


@dataclass
class SftConfig:
    """``t1async sft``: supervised warm start on oracle demonstrations (t1async/commands/sft.py)."""

    steps: int = 400
    """Optimizer steps."""
    batch_size: int = 8
    """Demonstrations per step (drawn without replacement within a step, seeded)."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, then cosine decay to 10 %)."""
    warmup_steps: int = 20
    """Steps of linear learning-rate warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss, which keeps every expert in use."""
    max_demos: int = 0
    """Use at most this many demonstrations (the first by task name; 0 = all)."""
    seed: int = 0
    """Seed of the batch order."""
    log_every: int = 20
    """Steps per point of the reported loss curve."""
    threads: int = 2
    """torch intra-op threads of the training process."""
    build_concurrency: int = 2
    """Demonstration episodes run at once, each in its own sandbox."""
    early_stop_frac: float = 0.0
    """An imperfect demonstrator (0 <= f < 1; default 0, the oracle): this fraction of the tasks
    (chosen by ``seed``) is played by a demonstrator that sends the end signal in place of the
    oracle's last command (an oracle of one command is played whole, and not counted as stopped
    early), and the demonstration is kept although its verifier does not resolve it, as an
    unfiltered set of a weaker agent's episodes would be (stopping before the task is done is a
    common failure of terminal agents). The warm start then learns to stop early on tasks whose
    oracle has several commands: a behaviour the verifier's reward can correct and imitation
    cannot (``t1async bench learning``)."""


@dataclass
class Config:
    """The whole run. Each component receives only its own section."""

    run: RunConfig = field(default_factory=RunConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    """Only ``t1async mismatch`` reads this section."""
    sft: SftConfig = field(default_factory=SftConfig)
    """Only ``t1async sft`` reads this section."""


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Merge a YAML file and ``key=value`` overrides onto the defaults of :class:`Config`.

    Args:
        path: YAML file whose keys override the defaults, or None for defaults only.
        overrides: dotted ``section.key=value`` strings applied after the file.

    Returns:
        A :class:`Config` instance (a typed dataclass, not a DictConfig).

    Raises:
        ConfigError: the file is missing or not YAML, or a key is unknown or a value has the
            wrong type; the message names the key and the file (or "command line").
    """
    from omegaconf import DictConfig, OmegaConf  # (omegaconf: deferred, so the dataclasses import without it, e.g. on a GPU box)
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException  # (omegaconf: as above)

    base = OmegaConf.structured(Config)
    layers = []
    if path is not None:
        layers.append((str(path), _load_yaml(Path(path))))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} on the command line is not key=value (for example learner.max_steps=4)")
    if overrides:
        import yaml  # (yaml: deferred, as omegaconf)

        try:
            layers.append(("command line", OmegaConf.from_dotlist(list(overrides))))
        except (yaml.YAMLError, OmegaConfBaseException) as e:  # a value YAML cannot read, e.g. key={a} b
            raise ConfigError(f"command line: an override is not valid YAML ({str(e).splitlines()[0]}); quote "
                              "the value, e.g. 'rollout.agent_command=\"python tools/example_agent.py\"'") from None
    merged = base
    for source, layer in layers:
        if not isinstance(layer, DictConfig):
            raise ConfigError(f"{source}: the top level must be a mapping of sections (run:, learner:, ...), "
                              f"not a {type(layer).__name__}")
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or "?"
            reason = str(e).splitlines()[0]
            hint = _valid_keys_hint(key) if isinstance(e, ConfigKeyError) else ""
            what = "bad key" if isinstance(e, ConfigKeyError) else "bad value of"  # unknown key, or a wrong type
            raise ConfigError(f"{source}: {what} {key!r}: {reason}{hint}") from None
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    check_values(cfg, source=" / ".join(s for s, _ in layers) or "defaults")
    return cfg


def _load_yaml(p: Path) -> Any:
    """A config file as a DictConfig.

    Raises:
        ConfigError: one line: missing, a folder, unreadable, not YAML (with line and column), or
            not a mapping of sections (a bare scalar or a list).
    """
    import yaml  # (yaml, omegaconf: deferred, as in load_config)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException  # (omegaconf: as above)

    if p.is_dir():
        raise ConfigError(f"config file {p} is a folder; pass a YAML file such as configs/local.yaml")
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; pass a YAML file such as configs/local.yaml")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"config file {p} is not valid YAML: {where}{e.problem or e.context}") from None
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} cannot be read as YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: the top level must be a mapping of sections (run:, learner:, ...), "
                          f"not a {type(data).__name__}")
    try:
        return OmegaConf.create(data)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config file {p}: {str(e).splitlines()[0]}") from None


# (dotted key, predicate, what a valid value is): checked after merging, so a value that would
# make the run hang or do nothing is refused up front.
_VALUE_RULES: list[tuple[str, Any, str]] = [
    ("learner.max_steps", lambda v: v >= 0, "an integer >= 0 (0: run until stopped)"),
    ("learner.batch_size", lambda v: v >= 1, "an integer >= 1"),
    ("learner.publish_every", lambda v: v >= 1, "an integer >= 1"),
    ("learner.max_staleness", lambda v: v >= 0, "an integer >= 0"),
    ("learner.ppo_epochs", lambda v: v >= 1, "an integer >= 1"),
    ("learner.critic_warmup_steps", lambda v: v >= 0, "an integer >= 0"),
    ("learner.lr_warmup_steps", lambda v: v >= 0, "an integer >= 0 (0: none)"),
    ("learner.kl_coef", lambda v: v >= 0, "a float >= 0 (0: no KL penalty)"),
    ("learner.reward", lambda v: v in ("dense", "binary"), "'dense' (tests passed) or 'binary' (resolved)"),
    ("run.log_retention", lambda v: v >= 1, "an integer >= 1"),
    ("learner.episodes_per_step", lambda v: v >= 0, "an integer >= 0 (0: no transcripts)"),
    ("run.learner_restarts", lambda v: v >= 0, "an integer >= 0 (0: never restart)"),
    ("run.sampler_restarts", lambda v: v >= 0, "an integer >= 0 (0: never restart)"),
    ("learner.keep_checkpoints", lambda v: v >= 1, "an integer >= 1 (the newest is needed to resume)"),
    ("learner.keep_every", lambda v: v >= 0, "an integer >= 0 (0: keep no older history)"),
    ("learner.checkpoint_every", lambda v: v >= 0, "an integer >= 0 (0: final checkpoint only)"),
    ("learner.lr", lambda v: v > 0, "a positive float"),
    ("learner.is_cap", lambda v: v >= 1, "a float >= 1"),
    ("learner.clip_eps", lambda v: 0 < v < 1, "a float in (0, 1)"),
    ("learner.gamma", lambda v: 0 <= v <= 1, "a float in [0, 1]"),
    ("learner.lam", lambda v: 0 <= v <= 1, "a float in [0, 1]"),
    ("learner.batch_timeout_s", lambda v: v > 0, "a positive number of seconds (the longest wait for a batch)"),
    ("rollout.num_actors", lambda v: v >= 1, "an integer >= 1 (scale live through the controller)"),
    ("rollout.group_size", lambda v: v >= 1, "an integer >= 1 (episodes per drawn task)"),
    ("learner.advantage", lambda v: v in ADVANTAGE_NAMES, "'gae' (the critic), 'group' (leave-one-out over a task's episodes)"
     " or 'grpo' (group mean and standard deviation)"),
    ("learner.policy_loss", lambda v: v in POLICY_LOSS_NAMES, "'ppo' (decoupled PPO with a truncated importance weight)"),
    ("learner.group_window_steps", lambda v: v >= 0, "an integer >= 0"),
    ("learner.negative_advantage_weight", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("rollout.admission", lambda v: v in ("oldest_episode", "learner_version", "learner_wait"),
     "'oldest_episode' (actors wait for slow episodes), 'learner_version' (AReaL's rule: drops what gets too"
     " stale) or 'learner_wait' (actors run ahead, the learner waits for slow episodes)"),
    ("rollout.agent", lambda v: v in ("builtin", "external"),
     "'builtin' (the rollout loop) or 'external' (rollout.agent_command through the OpenAI-compatible endpoint)"),
    ("rollout.history_break", lambda v: v in ("split", "drop"), "'split' (exact segments) or 'drop' (the episode)"),
    ("sampler.num_samplers", lambda v: v >= 1, "an integer >= 1"),
    ("env.max_turns", lambda v: v >= 1, "an integer >= 1"),
    ("env.max_context_tokens", lambda v: v >= 0, "an integer >= 0 (0: model.max_position_embeddings)"),
    ("learner.micro_batch_tokens", lambda v: v >= 0, "an integer >= 0 (0: one trajectory per micro-batch)"),
    ("learner.max_tokens_per_chunk", lambda v: v >= 0, "an integer >= 0 (0: never chunk)"),
    ("env.network", lambda v: v in ("task", "harness", "on", "off"),
     "'task' (the task's allow_internet), 'harness' (TB1 on, TB2 allow_internet), 'on' or 'off'"),
    ("env.action_format", lambda v: v in ("command", "tool_call"),
     "'command' (the message is the shell command) or 'tool_call' (Qwen3 tool calls of a bash tool)"),
    ("generation.max_new_tokens", lambda v: v >= 1, "an integer >= 1"),
    ("generation.temperature", lambda v: v >= 0, "a float >= 0 (0: greedy)"),
    ("generation.top_p", lambda v: 0 < v <= 1, "a float in (0, 1]"),
    ("generation.top_k", lambda v: v == -1 or v >= 1, "-1 (keep all) or an integer >= 1"),
    ("transport.scheme", lambda v: v in ("tcp", "ipc"), "'tcp' (between machines) or 'ipc' (one machine)"),
    ("transport.port", lambda v: 0 <= v <= 65535, "a TCP port in [0, 65535] (0: any free port)"),
    ("transport.rcvhwm", lambda v: v >= 1, "an integer >= 1"),
    ("transport.sndhwm", lambda v: v >= 1, "an integer >= 1"),
    ("transport.log_group_messages", lambda v: v >= 1, "an integer >= 1 (1: a receive-log flush per trajectory)"),
    ("transport.recv_queue_messages", lambda v: v >= 0, "an integer >= 0 (0: 4 x batch size, at least 8)"),
    ("transport.recv_queue_bytes", lambda v: v >= 1, "a positive number of bytes"),
    ("transport.window_messages", lambda v: v >= 1, "an integer >= 1"),
    ("transport.window_bytes", lambda v: v >= 1, "a positive number of bytes"),
    ("transport.spool_max_messages", lambda v: v >= 1, "an integer >= 1"),
    ("transport.spool_max_bytes", lambda v: v >= 1, "a positive number of bytes"),
    ("transport.send_timeout_s", lambda v: v > 0, "a positive number of seconds"),
    ("transport.ack_timeout_s", lambda v: v > 0, "a positive number of seconds"),
    ("transport.log_fsync", lambda v: v in ("always", "never"), "'always' or 'never'"),
    ("transport.max_message_bytes", lambda v: v >= 1, "a positive number of bytes"),
    ("sampler.backend", lambda v: v in ("embedded", "sglang"), "'embedded' or 'sglang'"),
    ("sampler.tp_size", lambda v: v >= 1, "an integer >= 1"),
    ("sampler.start_timeout_s", lambda v: v > 0, "a positive number of seconds"),
    ("sampler.dtype", lambda v: v in ("float32", "bfloat16", "float16"), "float32, bfloat16 or float16"),
    ("weight_sync.mode", lambda v: v in ("distributed", "tensor"),
     "'distributed' (a broadcast group, samplers anywhere) or 'tensor' (CUDA IPC / shared memory, samplers on this machine)"),
    ("weight_sync.backend", lambda v: v in ("gloo", "nccl"), "'gloo' (CPU) or 'nccl' (GPUs)"),
    ("weight_sync.timeout_s", lambda v: v > 0, "a positive number of seconds"),
    ("weight_sync.bucket_mb", lambda v: v > 0, "a positive number of MiB"),
    ("weight_sync.pause_mode", lambda v: v == "abort", "'abort' (see WeightSyncConfig.pause_mode)"),
    ("mismatch.learner_dtype", lambda v: v in ("float32", "bfloat16"), "float32 or bfloat16"),
    ("mismatch.episodes", lambda v: v >= 1, "an integer >= 1"),
    ("model.num_experts", lambda v: v >= 1, "an integer >= 1"),
    ("sft.steps", lambda v: v >= 1, "an integer >= 1"),
    ("sft.batch_size", lambda v: v >= 1, "an integer >= 1"),
    ("sft.lr", lambda v: v > 0, "a positive float"),
    ("sft.warmup_steps", lambda v: v >= 0, "an integer >= 0"),
    ("sft.max_demos", lambda v: v >= 0, "an integer >= 0 (0: all)"),
    ("sft.log_every", lambda v: v >= 1, "an integer >= 1"),
    ("sft.build_concurrency", lambda v: v >= 1, "an integer >= 1"),
    ("sft.early_stop_frac", lambda v: 0 <= v < 1, "a float in [0, 1)"),
    ("model.num_hidden_layers", lambda v: v >= 1, "an integer >= 1"),
    ("learner.backend", lambda v: v in ("torch", "megatron"),
     "'torch' (plain PyTorch) or 'megatron' (megatron-core; pip install 't1async[megatron]')"),
    ("learner.megatron.tensor_parallel", lambda v: v >= 1,
     "an integer >= 1 that divides the attention heads, key/value heads, vocabulary and moe_intermediate_size"),
    ("learner.megatron.pipeline_parallel", lambda v: v >= 1, "an integer >= 1 that divides model.num_hidden_layers"),
    ("learner.megatron.expert_parallel", lambda v: v >= 1, "an integer >= 1 that divides model.num_experts"),
    ("learner.megatron.timeout_s", lambda v: v > 0, "a positive number of seconds"),
    ("learner.megatron.dispatcher", lambda v: v in ("auto", "allgather", "alltoall"),
     "'auto', 'allgather' or 'alltoall' (CUDA only)"),
    ("learner.megatron.dtype", lambda v: v in ("float32", "bfloat16"), "float32 or bfloat16"),
    ("learner.megatron.device", lambda v: v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", v) is not None,
     "'auto', 'cpu', 'cuda' or 'cuda:K'"),
    *[(f"learner.abnormal.{kind}", lambda v: v in ("train", "mask_turn", "drop"), "'train', 'mask_turn' or 'drop'")
      for kind in ("length_cut", "aborted", "command_timeout", "sandbox_refused", "tool_call_error")],
    *[(f"learner.abnormal.{kind}", lambda v: v in ("train", "drop"),
       "'train' or 'drop' (an episode-level end has no one turn to mask)")
      for kind in ("context_full", "episode_timeout")],
]

def tensor_parallel_sizes(m: ModelConfig) -> dict[str, int]:
    """The sizes ``learner.megatron.tensor_parallel`` must divide: Megatron splits the heads and
    query groups, the vocabulary and each expert's MLP width over the tensor-parallel ranks."""
    return {"num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_key_value_heads,
            "vocab_size": m.vocab_size, "moe_intermediate_size": m.moe_intermediate_size}


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_parallel_choices(m: ModelConfig) -> list[int]:
    """The ``learner.megatron.tensor_parallel`` sizes that divide every one of :func:`tensor_parallel_sizes`."""
    sizes = tensor_parallel_sizes(m).values()
    return [d for d in divisors(m.num_key_value_heads) if all(v % d == 0 for v in sizes)]


# (rule over the whole config, the keys it concerns, what must hold: text, or a function of the config)
_CROSS_RULES: list[tuple[Any, str, Any]] = [
    (lambda c: c.env.max_context_tokens == 0 or c.env.max_context_tokens > c.generation.max_new_tokens,
     "env.max_context_tokens", "0 (the model's context) or more than generation.max_new_tokens"),
    (lambda c: c.rollout.agent != "external" or c.rollout.agent_command.strip() != "", "rollout.agent_command",
     "the agent program to run when rollout.agent=external (e.g. 'python tools/example_agent.py')"),
    (lambda c: 1 <= c.model.num_experts_per_tok <= c.model.num_experts, "model.num_experts_per_tok",
     "between 1 and model.num_experts"),
    (lambda c: c.model.num_key_value_heads >= 1 and c.model.num_attention_heads % c.model.num_key_value_heads == 0,
     "model.num_key_value_heads", "a divisor of model.num_attention_heads"),
    (lambda c: c.model.num_experts % c.learner.megatron.expert_parallel == 0, "learner.megatron.expert_parallel",
     lambda c: (f"a divisor of model.num_experts={c.model.num_experts}, one of "
                f"{divisors(c.model.num_experts)} "
                "(each rank holds num_experts / expert_parallel experts)")),
    (lambda c: c.learner.megatron.tensor_parallel in tensor_parallel_choices(c.model), "learner.megatron.tensor_parallel",
     lambda c: (f"a divisor of each of {tensor_parallel_sizes(c.model)}, one of {tensor_parallel_choices(c.model)} "
                "(Megatron splits heads, vocabulary and expert width over the tensor-parallel ranks)")),
    (lambda c: c.model.num_hidden_layers % c.learner.megatron.pipeline_parallel == 0, "learner.megatron.pipeline_parallel",
     lambda c: (f"a divisor of model.num_hidden_layers={c.model.num_hidden_layers}, one of "
                f"{divisors(c.model.num_hidden_layers)} "
                "(each stage holds num_hidden_layers / pipeline_parallel layers)")),
    (lambda c: c.learner.megatron.pipeline_parallel == 1 or not c.model.tie_word_embeddings,
     "learner.megatron.pipeline_parallel", "1 when model.tie_word_embeddings (the tied embedding and LM head would "
     "sit on two stages)"),
    (lambda c: not c.sampler.urls or c.sampler.backend == "sglang", "sampler.urls",
     "empty unless sampler.backend=sglang (the embedded samplers start on this machine and would ignore it)"),
]


def check_values(cfg: Config, source: str = "config") -> None:
    """Refuse values that are well typed but meaningless (a run of -1 steps, zero rollout actors).

    Raises:
        ConfigError: naming the key, the value, what is valid, and where the config came from.
    """
    for key, ok, valid in _VALUE_RULES:
        value: Any = cfg
        for name in key.split("."):
            value = getattr(value, name)
        if not ok(value):
            raise ConfigError(f"{source}: {key}={value!r} is invalid: use {valid}")
    for ok, key, valid in _CROSS_RULES:
        if not ok(cfg):
            value = cfg
            for name in key.split("."):
                value = getattr(value, name)
            raise ConfigError(f"{source}: {key}={value!r} is invalid: it must be "
                              f"{valid(cfg) if callable(valid) else valid}")


def check_trainable(cfg: Config) -> None:
    """Refuse settings the learner cannot train with (``t1async launch``, ``t1async mismatch``;
    not :func:`load_config`, so ``t1async eval`` may still sample greedily): a critic turned off
    while the advantage or a critic warm-up needs it, and generation settings the learner cannot
    reproduce.

    Temperature 0 is greedy: the sampled distribution is a point mass, which has no density to
    score a token under, so its log-prob carries no gradient.

    Raises:
        ConfigError: one line naming the key, the value and what to use instead.
    """
    if not cfg.learner.critic and cfg.learner.advantage == "gae":
        raise ConfigError(f"learner.critic=false needs learner.advantage=group (advantage "
                          f"{cfg.learner.advantage!r} estimates from the critic); turn the critic on or use group")
    if not cfg.learner.critic and cfg.learner.critic_warmup_steps > 0:
        raise ConfigError("learner.critic=false with learner.critic_warmup_steps > 0: there is no critic to warm "
                          "up; set critic_warmup_steps=0")
    if cfg.generation.temperature == 0:
        raise ConfigError("generation.temperature=0 (greedy) cannot be trained on: a point mass has no "
                          "density, so its log-prob carries no gradient; use a temperature > 0 for training "
                          "(greedy decoding is for t1async eval)")


def _valid_keys_hint(key: str) -> str:
    """``"; valid keys of learner: a, b, ..."`` for the section of ``key`` (empty if unknown)."""
    parts = key.split(".")
    node: Any = Config()
    for part in parts[:-1]:
        node = getattr(node, part, None)
        if node is None or not hasattr(node, "__dataclass_fields__"):
            return ""
    where = ".".join(parts[:-1]) or "the top level"
    return f"; valid keys of {where}: {', '.join(node.__dataclass_fields__)}"


def to_yaml(cfg: Any) -> str:
    """Render a config (or one section of it) as YAML, for saving in the run directory."""
    from omegaconf import OmegaConf  # (omegaconf: deferred, as in load_config)

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
