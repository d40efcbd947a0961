"""Typed configuration: one dataclass per component, defaults in code, YAML only overrides.

A config file (``configs/*.yaml``) and ``key=value`` overrides on the command line are merged
onto :class:`Config` with OmegaConf's structured-config mode, so an unknown key or a value of
the wrong type is refused with :class:`ConfigError` naming the key and where it came from.
Each component receives only its own section (``cfg.learner`` for the learner, and so on).

The sections live by stage in t1async/config/run.py, rollout.py and learner.py (each a dataclass
with a docstring under every field). Each validates itself: the rule of a field is declared beside
it and the section's ``check`` applies them (t1async/config/rules.py); a choice is a ``str`` Enum
(:class:`~t1async.config.rules.Choice`) whose values can be listed. This module holds the whole
:class:`Config`, the loading, the rules that relate fields of two sections (``_CROSS_RULES``) and
the learner's own refusals (:func:`check_trainable`), and re-exports every section and choice.
The checks of what a config points at (files, ports, tasks) are launch's pre-flight
(t1async/service/preflight.py).

Source of the merge semantics: OmegaConf 2.x structured configs
(https://omegaconf.readthedocs.io/en/latest/structured_config.html).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from t1async.config.errors import ConfigError
from t1async.config.learner import (
    ADVANTAGE_NAMES,
    POLICY_LOSS_NAMES,
    AbnormalAction,
    AbnormalConfig,
    AdvantageName,
    Dispatcher,
    LearnerBackendName,
    LearnerConfig,
    MegatronConfig,
    MismatchConfig,
    PolicyLossName,
    Reward,
    SftConfig,
    TrainDtype,
)
from t1async.config.model_folder import MODEL_TYPES, decoder_config, refuse_size_keys, resolve_model
from t1async.config.rollout import (
    ActionFormat,
    Admission,
    Agent,
    ContainerConfig,
    EnvConfig,
    GenerationConfig,
    HistoryBreakAction,
    Network,
    RolloutConfig,
    SamplerBackend,
    SamplerConfig,
    SamplerDtype,
    SandboxName,
    agent_weights,
)
from t1async.config.rules import Choice, FieldError, Section, field_rule
from t1async.config.run import (
    PLACEMENT_ROLES,
    RESERVED_RESOURCES,
    WANDB_MODES,
    LogFsync,
    MetricsConfig,
    ModelConfig,
    PauseMode,
    RayConfig,
    RunConfig,
    Scheme,
    TransportConfig,
    WandbMode,
    WeightSyncBackend,
    WeightSyncConfig,
    WeightSyncMode,
)

__all__ = [
    "ADVANTAGE_NAMES",
    "AbnormalAction",
    "AbnormalConfig",
    "ActionFormat",
    "Admission",
    "AdvantageName",
    "Agent",
    "Choice",
    "Config",
    "ConfigError",
    "ContainerConfig",
    "Dispatcher",
    "EnvConfig",
    "FieldError",
    "GenerationConfig",
    "HistoryBreakAction",
    "LearnerBackendName",
    "LearnerConfig",
    "LogFsync",
    "MODEL_TYPES",
    "MegatronConfig",
    "MetricsConfig",
    "MismatchConfig",
    "ModelConfig",
    "Network",
    "PLACEMENT_ROLES",
    "POLICY_LOSS_NAMES",
    "PauseMode",
    "PolicyLossName",
    "RESERVED_RESOURCES",
    "RayConfig",
    "Reward",
    "RolloutConfig",
    "RunConfig",
    "SamplerBackend",
    "SamplerConfig",
    "SamplerDtype",
    "SandboxName",
    "Scheme",
    "Section",
    "SftConfig",
    "TrainDtype",
    "TransportConfig",
    "WANDB_MODES",
    "WandbMode",
    "WeightSyncBackend",
    "WeightSyncConfig",
    "WeightSyncMode",
    "agent_weights",
    "check_trainable",
    "check_values",
    "divisors",
    "from_node",
    "load_config",
    "sections",
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
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError  # (omegaconf: as above)

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
            layers.append(("command line", OmegaConf.from_dotlist([_choice_word(o) for o in overrides])))
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
            bad_choice = _choice_refusal(key, getattr(e, "value", None)) if isinstance(e, ValidationError) else None
            if bad_choice is not None:  # a value outside a Choice field's Enum: the field's own rule text
                raise bad_choice.at(source) from None
            reason = str(e).splitlines()[0]
            hint = _valid_keys_hint(key) if isinstance(e, ConfigKeyError) else ""
            what = "bad key" if isinstance(e, ConfigKeyError) else "bad value of"  # unknown key, or a wrong type
            raise ConfigError(f"{source}: {what} {key!r}: {reason}{hint}") from None
    if merged.model.path:  # the folder is the architecture: size keys beside it would contradict it
        refuse_size_keys([str(k) for _, layer in layers if isinstance(layer.get("model"), DictConfig)
                          for k in layer["model"]])
    return from_node(merged, source=" / ".join(s for s, _ in layers) or "defaults")


def from_node(node: Any, source: str = "config") -> Config:
    """The :class:`Config` a merged OmegaConf node describes, its values checked (:func:`check_values`).

    Args:
        node: a structured ``DictConfig`` of :class:`Config` (``OmegaConf.merge`` of the layers).
        source: where the values came from, for the message (``command line``, ``scale``).

    Raises:
        ConfigError: as :func:`check_values`.
    """
    from omegaconf import OmegaConf  # (omegaconf: deferred, as in load_config)

    cfg: Config = OmegaConf.to_object(node)  # type: ignore[assignment]
    cfg.model = resolve_model(cfg.model)  # model.path: the architecture from the folder's config.json
    check_values(cfg, source)
    return cfg


def _choice_word(override: str) -> str:
    """``key=value`` with ``value`` quoted when ``key`` is a :class:`Choice` field and ``value`` a bare word,
    so that YAML 1.1 does not read ``on``/``off``/``yes``/``no`` as booleans (``env.network=on``)."""
    key, value = override.split("=", 1)
    f = _field(key.strip())
    if f is not None and isinstance(f.default, Choice) and re.fullmatch(r"[A-Za-z][\w.-]*", value.strip()):
        return f'{key}="{value.strip()}"'
    return override


def _choice_refusal(key: str, value: Any) -> FieldError | None:
    """The refusal of a scalar ``value`` OmegaConf would not convert for the :class:`Choice` field
    ``key``, worded by that field's rule (as a refused value of any field is); None when ``key``
    is not a Choice field."""
    f = _field(key)
    r = field_rule(f) if f is not None else None
    if r is None or not isinstance(f.default, Choice) or not isinstance(value, (str, int, float, bool)):
        return None  # (a list, a mapping or null: OmegaConf's own words say more)
    return FieldError(key, str(value), r.valid)  # (a str field would have held str(value) and refused it)


def _field(key: str) -> dataclasses.Field | None:
    """The dataclass field dotted ``key`` names in :class:`Config`, or None."""
    node: Any = Config
    f = None
    for part in key.split("."):
        fields = {x.name: x for x in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        f = fields.get(part)
        if f is None:
            return None
        node = f.default_factory if f.default_factory is not dataclasses.MISSING else None
    return f


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


_TP_FAMILY_SIZES = {"qwen3_5_moe": ("linear_num_key_heads", "linear_num_value_heads", "shared_expert_intermediate_size")}
"""Per ``model_type``: its config.json sizes megatron also splits over the tensor-parallel ranks (Qwen3.5's Gated
DeltaNet heads, megatron-core's TransformerConfig asserts them; its shared expert's width)."""


def tensor_parallel_sizes(m: ModelConfig) -> dict[str, int]:
    """The sizes ``learner.megatron.tensor_parallel`` must divide: Megatron splits the heads and
    query groups, the vocabulary and each expert's MLP width over the tensor-parallel ranks, and
    the width of a family's dense MLP layers (glm4_moe's first ``first_k_dense_replace`` layers) and a family's
    own split sizes its config.json states (:data:`_TP_FAMILY_SIZES`)."""
    out = {"num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_key_value_heads,
           "vocab_size": m.vocab_size, "moe_intermediate_size": m.moe_intermediate_size}
    if m.model_type == "glm4_moe" and int((m.hf_config or {}).get("first_k_dense_replace") or 0) > 0:
        out["intermediate_size"] = int(m.hf_config["intermediate_size"])
    if m.hf_config and m.model_type in _TP_FAMILY_SIZES:
        d = decoder_config(m.hf_config)
        out.update({k: int(d[k]) for k in _TP_FAMILY_SIZES[m.model_type] if d.get(k) is not None})
    return out


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_parallel_choices(m: ModelConfig) -> list[int]:
    """The ``learner.megatron.tensor_parallel`` sizes that divide every one of :func:`tensor_parallel_sizes`."""
    sizes = tensor_parallel_sizes(m).values()
    return [d for d in divisors(m.num_key_value_heads) if all(v % d == 0 for v in sizes)]


# Rules that relate fields of two sections (those within one section are its RULES): (rule over the whole
# config, the key it names, what that key must be: text, or a function of the config)
_CROSS_RULES: list[tuple[Any, str, Any]] = [
    (lambda c: c.env.max_context_tokens == 0 or c.env.max_context_tokens > c.generation.max_new_tokens,
     "env.max_context_tokens", "0 (the model's context) or more than generation.max_new_tokens"),
    (lambda c: c.env.max_context_tokens <= c.model.max_position_embeddings, "env.max_context_tokens",
     lambda c: (f"at most model.max_position_embeddings={c.model.max_position_embeddings} (the model's context: "
                "the learner refuses a longer trajectory as length), or 0 for the model's context")),
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
]


def sections(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Section]]:
    """Every section of ``cfg`` (a :class:`Config`, or a section) below it, with its dotted key,
    depth first in field order: ``("run", cfg.run)``, ..., ``("learner.abnormal", ...)``, ..."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, Section):
            key = f"{prefix}{f.name}"
            yield key, value
            yield from sections(value, f"{key}.")


def check_values(cfg: Config, source: str = "config") -> None:
    """Refuse values that are well typed but meaningless (a run of -1 steps, zero rollout actors):
    each section's own rules (:meth:`~t1async.config.rules.Section.check`), then ``_CROSS_RULES``.

    Raises:
        ConfigError: naming the key, the value, what is valid, and where the config came from.
    """
    for key, section in sections(cfg):
        try:
            section.check(key)
        except FieldError as e:
            raise e.at(source) from None
    for ok, key, valid in _CROSS_RULES:
        if not ok(cfg):
            value: Any = cfg
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
