"""``model.path``: the architecture of a run read from a Hugging Face model folder's config.json.

With ``model.path: DIR`` the folder is the single source of the architecture, the tokenizer, the chat
template and the end-of-turn ids. Here, at config time and from ``DIR/config.json`` alone (no weights
read, nothing heavy imported), :func:`resolve_model` fills the :class:`~t1async.config.run.ModelConfig`
fields every stage reads (vocabulary, layers, experts, top-k, context), keeps the whole config.json in
``model.hf_config`` for the family's own implementation, and refuses:

- a folder without config.json, or an unknown ``model_type`` (the message lists :data:`MODEL_TYPES`);
- ``model.*`` size keys given together with ``model.path`` (:func:`refuse_size_keys`): they would
  contradict the folder, so either is dropped by the user, never silently by us.

Field names: each family's config.json names (transformers 5.x ``Qwen3MoeConfig``,
``Qwen3_5MoeTextConfig``, ``Glm4MoeConfig``). A field may be written under more than one name, by one
transformers version or another (its config class's ``attribute_map``): :data:`FIELD_NAMES` lists, per family,
every name each ModelConfig field is found under, and :func:`decoder_config` reads whichever the file has
(Qwen3-MoE's expert count is ``num_experts`` up to transformers 5.24, ``num_local_experts`` from 5.25).
A conditional-generation config (Qwen3.5's ``Qwen3_5MoeForConditionalGeneration``) keeps the text decoder's
keys under ``text_config``: those are used.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from t1async.config.errors import ConfigError

__all__ = ["MODEL_TYPES", "SIZE_KEYS", "FIELD_NAMES", "decoder_config", "model_type_of", "resolve_model",
           "refuse_size_keys", "text_config"]

MODEL_TYPES = {
    "qwen3_moe": "Qwen3-MoE (t1async/models/model.py; torch and megatron learners)",
    "qwen3_5_moe": ("Qwen3.5-MoE text decoder, Gated DeltaNet + gated attention (t1async/models/qwen3_5_moe.py; "
                    "torch and megatron learners)"),
    "glm4_moe": ("GLM-4.5/4.6, transformers' own modeling with a routing-replay hook (t1async/models/hf_generic.py; "
                 "torch and megatron learners)"),
}
"""``model_type`` values t1async runs, with what runs them."""

FIELD_NAMES = {
    "qwen3_moe": {"num_experts": ("num_experts", "num_local_experts")},
    "glm4_moe": {"num_experts": ("n_routed_experts", "num_local_experts")},
}
"""Per family: ModelConfig field -> every config.json key a transformers version writes it under (where any
differs from the field's own name), the one transformers' config class stores first. From the classes'
``attribute_map`` (transformers 5.25: ``Qwen3MoeConfig`` {num_experts: num_local_experts}, ``Glm4MoeConfig``
{num_local_experts: n_routed_experts}; ``Qwen3_5MoeTextConfig`` has none); tests/test_model_folder.py checks this
table against the installed transformers."""

SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "rms_norm_eps",
             "rope_theta", "max_position_embeddings", "tie_word_embeddings", "initializer_range")
"""ModelConfig fields that describe the architecture: read from the folder, refused beside ``model.path``."""


def text_config(d: dict) -> dict:
    """The text decoder's config of a config.json dict: its ``text_config`` (a multimodal checkpoint such
    as Qwen3.5's) with the outer ``tie_word_embeddings`` kept when the inner one lacks it, else ``d``."""
    inner = d.get("text_config")
    if isinstance(inner, dict) and inner.get("model_type"):
        out = dict(inner)
        if "tie_word_embeddings" in d and "tie_word_embeddings" not in out:
            out["tie_word_embeddings"] = d["tie_word_embeddings"]
        return out
    return d


def decoder_config(d: dict) -> dict:
    """:func:`text_config` of ``d`` with every ModelConfig field of :data:`FIELD_NAMES` also under its own name
    (``num_experts`` from ``num_local_experts`` or ``n_routed_experts``, whichever the file has); ``d`` is not
    changed.

    Raises:
        ConfigError: two names of one field hold different values (one line naming both).
    """
    t = dict(text_config(d))
    for field_name, names in FIELD_NAMES.get(model_type_of(d), {}).items():
        found = {n: t[n] for n in names if t.get(n) is not None}
        if len(set(map(str, found.values()))) > 1:
            listed = ", ".join(f"{n}={v!r}" for n, v in found.items())
            raise ConfigError(f"config.json says {listed}: transformers reads them as one field ({field_name}); "
                              "keep the one that matches the weights and delete the other")
        if found:
            t[field_name] = next(iter(found.values()))
    return t


def model_type_of(d: dict) -> str:
    """The family ``model_type`` of a config.json dict (its text decoder's, a ``_text`` suffix dropped)."""
    d = text_config(d)
    mt = d.get("model_type")
    # the multimodal wrapper's own type names its text decoder's family (qwen3_5_moe_text -> qwen3_5_moe)
    if isinstance(mt, str) and mt.endswith("_text") and mt[:-5] in MODEL_TYPES:
        return mt[:-5]
    return mt  # type: ignore[return-value]


def refuse_size_keys(given: list[str]) -> None:
    """Refuse ``model.*`` keys set in a config layer together with ``model.path`` (``chat_template_kwargs`` goes
    with it).

    Args:
        given: the ``model.*`` keys (without the ``model.`` prefix) a file or the command line set.

    Raises:
        ConfigError: one line naming the keys.
    """
    bad = [k for k in given if k not in ("path", "hf_config", "chat_template_kwargs")]
    if bad:
        raise ConfigError(f"model.path takes the architecture from the folder's config.json, so model."
                          f"{', model.'.join(bad)} conflict{'s' if len(bad) == 1 else ''} with it; drop "
                          f"{'it' if len(bad) == 1 else 'them'}, or drop model.path to use the built-in model")


def resolve_model(model: Any) -> Any:
    """``model`` (a ModelConfig) with its size fields and ``hf_config`` read from ``model.path``'s config.json.

    Returns ``model`` itself when ``model.path`` is empty. Unknown config.json keys stay in ``hf_config``
    only; a size key the file lacks keeps the ModelConfig default (transformers' defaults differ per
    family: the family's implementation reads ``hf_config`` itself and refuses what it cannot run).

    Raises:
        ConfigError: no such folder, no or unreadable config.json, an unknown ``model_type``.
    """
    if not model.path:
        return model
    folder = Path(model.path).expanduser()
    path = folder / "config.json"
    if not folder.is_dir():
        raise ConfigError(f"model.path={model.path}: no such folder; give a Hugging Face model folder (config.json, "
                          "*.safetensors, tokenizer files), e.g. one `t1async model init` writes")
    if not path.is_file():
        raise ConfigError(f"model.path={model.path} has no config.json; a Hugging Face model folder holds config.json, "
                          "the safetensors weights and the tokenizer files (`t1async model init` writes one)")
    try:
        raw = json.loads(path.read_text("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not JSON ({e}); restore it from the model's source") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds a JSON {type(raw).__name__}, not an object")
    mt = model_type_of(raw)
    if mt not in MODEL_TYPES:
        listed = "; ".join(f"{k}: {v}" for k, v in MODEL_TYPES.items())
        raise ConfigError(f"model.path={model.path}: config.json has model_type {mt!r}, which t1async does not run; "
                          f"supported: {listed}")
    try:
        d = decoder_config(raw)
    except ConfigError as e:
        raise ConfigError(f"model.path={model.path}: {e}") from None
    kwargs: dict[str, Any] = {}
    for name in SIZE_KEYS:
        if d.get(name) is not None:
            kwargs[name] = d[name]
    if "head_dim" not in kwargs and "hidden_size" in kwargs and d.get("num_attention_heads"):
        kwargs["head_dim"] = int(kwargs["hidden_size"]) // int(d["num_attention_heads"])
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if "rope_theta" not in kwargs and isinstance(rope, dict) and "rope_theta" in rope:
        kwargs["rope_theta"] = rope["rope_theta"]
    types = {f.name: f.type for f in dataclasses.fields(model)}
    for k, v in list(kwargs.items()):  # config.json ints for float fields and the like
        t = types[k]
        kwargs[k] = float(v) if t in ("float", float) else bool(v) if t in ("bool", bool) else int(v) \
            if t in ("int", int) else v
    return dataclasses.replace(model, **kwargs, hf_config={**raw, "model_type": raw.get("model_type", mt)},
                               path=str(folder))
