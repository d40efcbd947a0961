"""Typed configuration: one dataclass per component, defaults in code, YAML only overrides.

A config file (``configs/*.yaml``) and ``key=value`` overrides on the command line are merged
onto :class:`Config` with OmegaConf's structured-config mode, so an unknown key or a value of
the wrong type is refused with :class:`ConfigError` naming the key and where it came from.
Each component receives only its own section (``cfg.learner`` for the learner, and so on).

The sections live by stage in t1async/config/run.py, rollout.py and learner.py (each a dataclass
with a docstring under every field); this module holds the whole :class:`Config`, the loading and
the checks, and re-exports every section.

Source of the merge semantics: OmegaConf 2.x structured configs
(https://omegaconf.readthedocs.io/en/latest/structured_config.html).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from t1async.config.errors import ConfigError
from t1async.config.learner import (
    ADVANTAGE_NAMES,
    POLICY_LOSS_NAMES,
    AbnormalConfig,
    LearnerConfig,
    MegatronConfig,
    MismatchConfig,
    SftConfig,
)
from t1async.config.rollout import ContainerConfig, EnvConfig, GenerationConfig, RolloutConfig, SamplerConfig
from t1async.config.run import (
    PLACEMENT_ROLES,
    RESERVED_RESOURCES,
    WANDB_MODES,
    MetricsConfig,
    ModelConfig,
    RayConfig,
    RunConfig,
    TransportConfig,
    WeightSyncConfig,
)

__all__ = [
    "ADVANTAGE_NAMES",
    "AbnormalConfig",
    "Config",
    "ConfigError",
    "ContainerConfig",
    "EnvConfig",
    "GenerationConfig",
    "LearnerConfig",
    "MegatronConfig",
    "MetricsConfig",
    "MismatchConfig",
    "ModelConfig",
    "PLACEMENT_ROLES",
    "POLICY_LOSS_NAMES",
    "RESERVED_RESOURCES",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplerConfig",
    "SftConfig",
    "TransportConfig",
    "WANDB_MODES",
    "WeightSyncConfig",
    "check_trainable",
    "check_values",
    "divisors",
    "load_config",
    "tensor_parallel_choices",
    "tensor_parallel_sizes",
    "to_yaml",
]




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
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
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
    ("learner.disk_floor_mb", lambda v: v >= 0, "MiB of free space >= 0 (0: no floor)"),
    ("metrics.wandb_mode", lambda v: v in WANDB_MODES, f"one of {', '.join(WANDB_MODES)}"),
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
    ("ray.placement", lambda v: all(role in PLACEMENT_ROLES and res.strip() and res not in RESERVED_RESOURCES
                                    for role, res in v.items()),
     f"a mapping of roles ({', '.join(PLACEMENT_ROLES)}) to custom Ray resource names, e.g. "
     "{learner: learner_node, rollout: rollout_node} (not empty, not one of " + ", ".join(RESERVED_RESOURCES) + ")"),
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
    ("transport.quarantine_prefix_bytes", lambda v: v >= 0, "a number of bytes >= 0"),
    ("transport.quarantine_max_bytes", lambda v: v >= 0, "a number of bytes >= 0 (0: keep none)"),
    ("transport.quarantine_max_files", lambda v: v >= 0, "an integer >= 0 (0: keep none)"),
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
