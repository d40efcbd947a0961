"""Config sections of the run as a whole: run directory and logs, Ray, the model, transport, weight sync."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from t1async.config.model_folder import SIZE_KEYS, model_type_of, text_config
from t1async.config.rules import Choice, Section, choice, rule, section_rule

PLACEMENT_ROLES = ("learner", "controller", "sampler", "rollout")
"""The roles ``ray.placement`` can place (the Ray actors ``launch`` starts)."""
RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Ray's built-in resources, which ``ray.placement`` cannot use as a node's mark."""



class Scheme(Choice):
    """``transport.scheme``: how rollout actors reach the learner's socket."""

    tcp = "tcp"
    """TCP, between machines"""
    ipc = "ipc"
    """A Unix socket, one machine"""


class LogFsync(Choice):
    """``transport.log_fsync``: receive-log durability before an acknowledgement."""

    always = "always"
    """fsync each record: survives power loss"""
    never = "never"
    """Page cache: survives a learner crash or SIGKILL, not the machine"""


class WeightSyncMode(Choice):
    """``weight_sync.mode``: how weights reach the samplers."""

    distributed = "distributed"
    """A broadcast group, samplers anywhere"""
    tensor = "tensor"
    """CUDA IPC / shared memory, samplers on the learner's machine"""


class WeightSyncBackend(Choice):
    """``weight_sync.backend``: torch.distributed backend of the broadcast group."""

    gloo = "gloo"
    """CPU"""
    nccl = "nccl"
    """GPUs"""


class PauseMode(Choice):
    """``weight_sync.pause_mode``: SGLang ``/pause_generation`` mode during an update."""

    abort = "abort"
    """Running requests end and are sent again after the update"""


@dataclass
class RunConfig(Section):
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
    log_retention: int = field(default=3, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Rotated files kept per role log (loguru ``retention``, a count)."""
    tensorboard: bool = True
    """Write each learner step's scalars as TensorBoard events to ``tensorboard/`` (tensorboardX)."""
    audit: bool = False
    """Record the id of every trajectory the rollout actors spooled in ``RUN_DIR/audit/`` (one line
    each; ``t1async soak`` turns it into its ledger). Grows with the run: for soaks, not services."""
    learner_restarts: int = field(default=3, metadata=rule(lambda v: v >= 0, "an integer >= 0 (0: never restart)"))
    """Restarts in a row of a learner that died (from its last checkpoint and the receive log, as
    ``learner.resume`` does); a learner that trained a step before dying starts a new row. Restarts
    in a row wait 5, 10, 20, 40, 60, 60 ... s (back-off); beyond this many the run stops with one
    line saying how to resume (0: never restart)."""
    sampler_restarts: int = field(default=3, metadata=rule(lambda v: v >= 0, "an integer >= 0 (0: never restart)"))
    """Restarts in a row of an embedded sampler that died (its Ray actor died, it failed three
    health checks in a row, or a weight update took it out of service), with the learner's
    back-off (5, 10, 20 ... 60 s); one that served a request before dying starts a new row. Beyond
    this many in a row it is left ``failed`` in ``t1async status`` (0: never restart)."""


class WandbMode(Choice):
    """``metrics.wandb_mode``: wandb's ``mode``."""

    offline = "offline"
    """No network or account; ``wandb sync`` uploads later"""
    online = "online"
    """Needs ``WANDB_API_KEY`` or ``wandb login``"""
    disabled = "disabled"


WANDB_MODES = WandbMode.values()
"""Values of ``metrics.wandb_mode``."""


@dataclass
class MetricsConfig(Section):
    """Where the launch process sends each learner step's scalars besides ``metrics.jsonl`` and
    TensorBoard (``run.tensorboard``); t1async/service/sinks.py."""

    wandb: bool = False
    """Also log them to Weights & Biases (extra ``wandb``: ``pip install 't1async[wandb]'``), in
    ``RUN_DIR/wandb``; every life of a run appends to one wandb run."""
    wandb_project: str = "t1async"
    """The wandb project."""
    wandb_mode: WandbMode = field(default=WandbMode.offline, metadata=choice(WandbMode, f"one of {', '.join(WANDB_MODES)}"))
    """wandb's ``mode``: ``offline`` (no network or account; ``wandb sync RUN_DIR/wandb/wandb/offline-run-*``
    uploads later), ``online`` (needs ``WANDB_API_KEY`` or ``wandb login``) or ``disabled``."""


@dataclass
class RayConfig(Section):
    """How ``launch`` reaches Ray."""

    address: Optional[str] = None
    """Address of an existing Ray cluster (``auto`` or ``host:port``); None starts a local one."""
    num_cpus: Optional[int] = None
    """CPUs a locally started Ray advertises; None lets Ray count them."""
    placement: Dict[str, str] = field(default_factory=dict, metadata=rule(
        lambda v: all(role in PLACEMENT_ROLES and res.strip() and res not in RESERVED_RESOURCES for role, res in v.items()),
        f"a mapping of roles ({', '.join(PLACEMENT_ROLES)}) to custom Ray resource names, e.g. "
        "{learner: learner_node, rollout: rollout_node} (not empty, not one of " + ", ".join(RESERVED_RESOURCES) + ")"))
    """Role -> custom Ray resource that marks the nodes it runs on, e.g. ``{learner: learner_node,
    controller: learner_node, sampler: rollout_node, rollout: rollout_node}`` with nodes started as
    ``ray start ... --resources '{"rollout_node": 1}'``. Roles: learner, controller, sampler,
    rollout; a role left out goes where Ray puts it. Each actor of a placed role asks for 0.001 of
    its resource (a mark, not a capacity: 1,000 actors fit a node marked 1); a role's actors take
    the live nodes that have it in turn (live: alive in Ray's node table and its raylet reachable,
    so a lost node gets no new actor while Ray has not yet marked it dead). Soft: when no live node
    has the resource (its nodes were lost), the role is started on any node, with a warning; a
    restart (a rollout actor, a sampler, the learner) looks again, so it goes back to marked nodes
    while one is alive. Empty: Ray places every role."""
    memory_mb: Optional[int] = field(default=None, metadata=rule(lambda v: v is None or v >= 1,
                                                                 "an integer >= 1 (MB) or null"))
    """Memory (MB) the bound on rollout actors and samplers counts on (t1async/service/capacity.py);
    None: what Ray's cluster offers (its ``memory`` resource, about 70 % of the nodes' memory free
    when Ray started)."""
    role_memory_mb: Dict[str, int] = field(
        default_factory=lambda: {"learner": 900, "controller": 300, "sampler": 400, "rollout": 300},
        metadata=rule(lambda v: set(v) == set(PLACEMENT_ROLES) and all(int(x) >= 1 for x in v.values()),
                      f"a mapping of every role ({', '.join(PLACEMENT_ROLES)}) to MB >= 1"))
    """Memory (MB) one actor of each role takes, for the bound on rollout actors and samplers: a
    launch clamps ``rollout.num_actors`` and ``sampler.num_samplers`` (a resume's live changes
    included) to what the cluster can hold, ``t1async scale`` refuses past it unless ``--force``
    (t1async/service/capacity.py). Defaults: the resident set size one process of each role
    reached on ``configs/local.yaml`` (``t1async bench role-memory``, docs/results), rounded up (a
    rollout actor's includes its sandbox's processes); run that bench for another model."""
    rollouts_per_cpu: int = field(default=8, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Rollout actors per Ray CPU at most (a rollout actor mostly waits for its sampler and sandbox)."""


RESERVED_TEMPLATE_KWARGS = ("messages", "conversation", "tools", "documents", "add_generation_prompt",
                            "continue_final_message", "tokenize", "return_dict", "chat_template")
"""Names of ``apply_chat_template``'s own arguments: never ``model.chat_template_kwargs``."""


@dataclass
class ModelConfig(Section):
    """Policy architecture, with Hugging Face ``Qwen3MoeConfig`` field names.

    Two ways to give it:

    - ``model.path: DIR``, a Hugging Face model folder (t1async/config/model_folder.py): the folder's
      config.json sets every field below and ``hf_config``; its weights, tokenizer, chat template and
      end-of-turn ids are the run's. Size keys given beside it are refused.
    - otherwise the fields below describe the built-in Qwen3-MoE (random init or
      ``learner.init_checkpoint``) with the shipped 4,096-id tokenizer; they are written verbatim (plus
      ``architectures`` and ``model_type``) as a checkpoint's config.json.
    """

    RULES = (
        section_rule(lambda m: 1 <= m.num_experts_per_tok <= m.num_experts, "num_experts_per_tok",
                     "between 1 and model.num_experts"),
        section_rule(lambda m: m.num_key_value_heads >= 1 and m.num_attention_heads % m.num_key_value_heads == 0,
                     "num_key_value_heads", "a divisor of model.num_attention_heads"),
        section_rule(lambda m: not m.chat_template_kwargs or bool(m.path), "chat_template_kwargs",
                     "empty without model.path (the built-in model's ChatML takes no template arguments)"),
    )

    vocab_size: int = 4096
    """Rows of the embedding and of the LM head; must be >= the tokenizer's vocabulary."""
    hidden_size: int = 128
    """Residual stream width."""
    num_hidden_layers: int = field(default=4, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Decoder layers; every layer is an MoE layer (``decoder_sparse_step`` = 1)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_attention_heads``."""
    head_dim: int = 32
    """Width of one attention head."""
    num_experts: int = field(default=8, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
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
    path: str = ""
    """Hugging Face model folder to train ('' = the built-in model above); see ``t1async model init``."""
    hf_config: Dict[str, Any] = field(default_factory=dict)
    """The folder's whole config.json (filled from ``model.path``; not set by hand)."""
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict, metadata=rule(
        lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v) and not set(v) & set(RESERVED_TEMPLATE_KWARGS),
        "a mapping of template variable names to values, e.g. {enable_thinking: false} (not "
        + ", ".join(RESERVED_TEMPLATE_KWARGS) + ": t1async sets those)"))
    """Variables passed to ``model.path``'s chat template at every rendering, the same way everywhere: the
    rollout's prompts and observations, ``t1async sft``'s demonstrations, ``t1async eval``'s policy episodes,
    the OpenAI-compatible endpoint and ``t1async model check`` (one renderer, t1async/models/families.py
    ``load_renderer``). ``{enable_thinking: false}``: Qwen3's, Qwen3.5's and GLM-4.6's templates open each
    assistant turn with an empty ``<think></think>`` block in the generation prompt, so the policy answers
    without reasoning (their default is thinking on: the policy samples the block itself); docs/training.md
    says which to set per family. Empty (the default) renders as transformers does without arguments."""

    @property
    def model_type(self) -> str:
        """The family: config.json's ``model_type`` (the text decoder's), ``qwen3_moe`` for the built-in model."""
        return model_type_of(self.hf_config) if self.hf_config else "qwen3_moe"

    def architecture(self) -> dict[str, Any]:
        """The size fields (:data:`~t1async.config.model_folder.SIZE_KEYS`) and the family: what two
        configs must share for one's weights to load into the other's model."""
        return {"model_type": self.model_type, **{k: getattr(self, k) for k in SIZE_KEYS}}

    @property
    def routed_layers(self) -> int:
        """MoE layers: the L of every routed-experts array ``[T, L, K]`` (GLM's first
        ``first_k_dense_replace`` layers are dense; every layer of the Qwen families is MoE)."""
        return self.num_hidden_layers - int(text_config(self.hf_config).get("first_k_dense_replace") or 0)


@dataclass
class TransportConfig(Section):
    """Trajectory transport: ZeroMQ DEALER (rollout actors) -> ROUTER (learner), acknowledged.

    Delivery is at least once, de-duplicated by trajectory id (see t1async/transport/transport.py): an actor
    spools each trajectory to disk, sends it, and frees its file (for reuse) when the learner
    acknowledges it after appending it to its durable receive log (RUN_DIR/receive_log).
    """

    scheme: Scheme = field(default=Scheme.tcp, metadata=choice(Scheme, "'tcp' (between machines) or 'ipc' (one machine)"))
    """``tcp`` (between machines) or ``ipc`` (one machine)."""
    host: str = "127.0.0.1"
    """Interface the learner binds (tcp) and actors connect to."""
    port: int = field(default=0, metadata=rule(lambda v: 0 <= v <= 65535, "a TCP port in [0, 65535] (0: any free port)"))
    """TCP port the learner binds; 0 picks a free one."""
    rcvhwm: int = field(default=64, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Learner ZeroMQ receive high-water mark, messages (ZeroMQ counts messages, not bytes; the
    byte bound is ``window_bytes`` per actor and ``recv_queue_bytes``)."""
    sndhwm: int = field(default=8, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Rollout actor ZeroMQ send high-water mark, messages."""
    recv_queue_messages: int = field(default=0, metadata=rule(
        lambda v: v >= 0, "an integer >= 0 (0: 4 x batch size, at least 8)"))
    """Decoded trajectories the learner holds in memory waiting for a batch (0: 4 x batch size,
    at least 8). When full, the learner stops reading the socket (backpressure)."""
    recv_queue_bytes: int = field(default=2 << 30, metadata=rule(lambda v: v >= 1, "a positive number of bytes"))
    """Bytes of decoded trajectories the learner holds in memory (one larger trajectory is still
    admitted into an empty queue)."""
    window_messages: int = field(default=64, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Trajectories one actor has sent and not yet had acknowledged (in flight)."""
    window_bytes: int = field(default=256 << 20, metadata=rule(lambda v: v >= 1, "a positive number of bytes"))
    """Bytes one actor has in flight; more waits in its on-disk spool."""
    spool_dir: str = ""
    """Folder of the actors' on-disk spools of unacknowledged trajectories. Empty: launch uses
    RUN_DIR/spool; an actor built without one uses a private temporary folder. A new actor
    adopts (and resends) the spool of an actor that died."""
    spool_max_bytes: int = field(default=4 << 30, metadata=rule(lambda v: v >= 1, "a positive number of bytes"))
    """Bytes one actor may keep spooled; ``send`` waits (backpressure) while the spool is fuller."""
    spool_max_messages: int = field(default=256, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Trajectories one actor may keep spooled; ``send`` waits while the spool holds more."""
    send_timeout_s: float = field(default=3600.0, metadata=rule(lambda v: v > 0, "a positive number of seconds"))
    """Longest ``send`` waits for spool room before it raises TransportError."""
    ack_timeout_s: float = field(default=300.0, metadata=rule(lambda v: v > 0, "a positive number of seconds"))
    """Resend a trajectory not acknowledged this long after it was sent (reconnects resend at once)."""
    log_fsync: LogFsync = field(default=LogFsync.always, metadata=choice(LogFsync, "'always' or 'never'"))
    """Receive-log durability before an acknowledgement: ``always`` (fsync each record: survives
    power loss) or ``never`` (page cache: survives a learner crash or SIGKILL, not the machine)."""
    log_group_messages: int = field(default=64, metadata=rule(
        lambda v: v >= 1, "an integer >= 1 (1: a receive-log flush per trajectory)"))
    """Most deliveries already waiting on the socket that the learner stores with one flush of
    the receive log before it ACKs any of them (group commit); 1: a flush per trajectory."""
    max_message_bytes: int = field(default=4 << 30, metadata=rule(lambda v: v >= 1, "a positive number of bytes"))
    """Largest trajectory frame the learner accepts (ZeroMQ drops the peer's connection beyond)."""
    quarantine_prefix_bytes: int = field(default=64 << 10, metadata=rule(lambda v: v >= 0, "a number of bytes >= 0"))
    """Bytes of each refused trajectory message kept in RUN_DIR/quarantine (its header and first
    arrays; never the whole message), beside its metadata: reason, error, size, sha256, time
    (t1async/transport/quarantine.py)."""
    quarantine_max_bytes: int = field(default=64 << 20, metadata=rule(lambda v: v >= 0, "a number of bytes >= 0 (0: keep none)"))
    """Most bytes RUN_DIR/quarantine keeps of refused messages (prefixes and metadata); beyond it
    the oldest are evicted and counted (``quarantine_evicted``). 0: keep none (still counted)."""
    quarantine_max_files: int = field(default=1000, metadata=rule(lambda v: v >= 0, "an integer >= 0 (0: keep none)"))
    """Most refused messages RUN_DIR/quarantine keeps; beyond it the oldest are evicted and counted."""
    curve: bool = True
    """Authenticate and encrypt trajectories and ACKs with CurveZMQ (on by default): the learner
    accepts only senders holding a key in ``keys_dir/authorized``, so no other process that reaches
    its port can train the policy. Keys come from ``keys_dir``; with ``keys_dir`` empty, launch
    makes them in ``RUN_DIR/keys`` (one host: the learner and the actors read the same folder;
    kept for a resume). Off (``false``) only where the learner binds a loopback address or
    ``scheme: ipc``: across hosts it is refused."""
    keys_dir: str = ""
    """Folder written by ``t1async keys DIR``: learner.key(_secret), rollout.key(_secret) and
    authorized/ (public keys of the actors the learner accepts). Empty: ``RUN_DIR/keys``, made at
    launch; required for a Ray cluster of several machines (``ray.address``), a folder each one reads."""


@dataclass
class WeightSyncConfig(Section):
    """How the learner hands its weights to every sampler (t1async/weights/)."""

    mode: WeightSyncMode = field(default=WeightSyncMode.distributed, metadata=choice(
        WeightSyncMode, "'distributed' (a broadcast group, samplers anywhere) or 'tensor' (CUDA IPC / shared memory, "
        "samplers on this machine)"))
    """``distributed``: SGLang's ``/update_weights_from_distributed``, the learner broadcasts each
    bucket over a torch.distributed group it forms with the samplers (samplers anywhere; on GPUs one
    rank per GPU). ``tensor``: SGLang's ``/update_weights_from_tensor``, for samplers on the
    learner's machine, including its own GPU (where NCCL refuses a second rank): each bucket goes
    as handles to the learner's memory, CUDA IPC on GPU or named shared memory on CPU, and the
    sampler copies it during the request; no group is formed, so ``backend``, ``master_address``
    and ``master_port`` are unused. Launch refuses ``tensor`` with ``sampler.urls`` on another host."""
    backend: WeightSyncBackend = field(default=WeightSyncBackend.gloo, metadata=choice(
        WeightSyncBackend, "'gloo' (CPU) or 'nccl' (GPUs)"))
    """torch.distributed backend of ``mode: distributed``: ``gloo`` (CPU) or ``nccl`` (GPUs)."""
    master_address: str = "127.0.0.1"
    """Address of the learner's rendezvous TCPStore."""
    master_port: int = 0
    """Port of the rendezvous TCPStore; 0 picks a free one."""
    timeout_s: float = field(default=120.0, metadata=rule(lambda v: v > 0, "a positive number of seconds"))
    """Timeout of the group's rendezvous, of each broadcast and of each weight-sync HTTP call
    (in ``tensor`` mode: of each call, the receiver's copy of a bucket included), seconds. Both
    ends for embedded samplers (the learner sends it when the group is formed); an SGLang server
    keeps torch's 30-minute group timeout, so the learner stops waiting after this
    long and takes that server out of service (left paused, never serving partial weights)."""
    bucket_mb: float = field(default=512.0, metadata=rule(lambda v: v > 0, "a positive number of MiB"))
    """Most MiB sent at once (distributed: SGLang ``load_format: flattened_bucket``, one uint8
    tensor per bucket; tensor: one ``/update_weights_from_tensor`` call per bucket); non-expert
    parameters first, then experts. Each bucket is allocated once more on both ends while it is in
    flight (tensor mode: on the learner's side only when its parameters are not packed)."""
    pause_mode: PauseMode = field(default=PauseMode.abort, metadata=choice(
        PauseMode, "'abort' (see WeightSyncConfig.pause_mode)"))
    """``/pause_generation`` mode during an update. Only ``abort``: running requests end and the
    client sends them again after the update (the pinned SGLang reports no per-token weight
    versions, so ``retract``/``in_place`` would label tokens of two versions with one)."""
