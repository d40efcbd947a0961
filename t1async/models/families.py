"""Model families: which implementation builds, loads and saves a ``model_type``, and the run's renderer.

Every stage builds its model through here, never through a class name, so a run with ``model.path``
gets the folder's family everywhere (learner, embedded samplers, SFT, eval, mismatch):

- :func:`build_model`: a seeded random init of the run's architecture (the samplers' shell before the
  first weights arrive, a run without a warm start);
- :func:`load_model`: a Hugging Face folder, streamed (t1async/models/hf_folder.py);
- :func:`save_model`: a checkpoint in the same layout, the source's config and tokenizer files copied;
- :func:`check_model_folder`: every refusal that can be made before loading: weights against the
  architecture (from the shards' headers, on a meta-device model), the tokenizer and template, a
  tokenizer larger than the embedding, memory;
- :func:`load_renderer`: the episode renderer: the model's own chat template for ``model.path``
  (t1async/models/chat_template.py), the shipped ChatML tokenizer otherwise.

A family is a :class:`Family`: ``model_type``, how to build the model from a ModelConfig, how one
checkpoint tensor maps onto the model's parameters (layout conversions such as transformers v5's fused
experts), and the learner backends that run it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger
from torch import nn

from t1async.config import MODEL_TYPES, ModelConfig
from t1async.config.model_folder import decoder_config, text_config
from t1async.models.chat_template import ChatTemplateRenderer, TemplateError
from t1async.models.hf_folder import (
    WEIGHTS,
    WEIGHTS_INDEX,
    Convert,
    ModelFolderError,
    check_memory,
    check_model_weights,
    fuse_expert,
    left_out,
    load_weights,
    read_config,
    save_folder,
    source_layout,
    weight_specs,
)
from t1async.models.hf_generic import HFMoeForCausalLM
from t1async.models.hf_generic import config_from_hf as hf_generic_config
from t1async.models.hf_generic import config_to_hf as hf_generic_config_to_hf
from t1async.models.model import Qwen3MoeForCausalLM, _unfuse_experts, model_config_from_hf, model_config_to_hf, save_hf
from t1async.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen35TextConfig
from t1async.models.qwen3_5_moe import config_from_hf as qwen35_config_from_hf
from t1async.models.qwen3_5_moe import config_to_hf as qwen35_config_to_hf
from t1async.models.qwen3_5_moe import hf_convert as qwen35_hf_convert
from t1async.models.tokenizer import ChatTokenizer

__all__ = ["Family", "FAMILIES", "family", "build_model", "load_model", "save_model", "checkpoint_rounds",
           "warn_left_out", "check_model_folder", "load_renderer", "SAMPLER_SKIPS", "sampler_weights",
           "check_sampler_names", "fuse_experts", "unfuse_experts"]

Named = Iterable[tuple[str, torch.Tensor]]
"""(name, tensor) pairs, as ``named_parameters()`` yields them."""


@dataclass(frozen=True)
class Family:
    """How t1async runs one ``model_type``.

    Attributes:
        model_type: config.json's ``model_type``.
        build: ModelConfig -> a model with fresh weights (the caller seeds torch).
        convert: (checkpoint tensor name, tensor) -> the model's (name, tensor) pairs, for a ModelConfig.
        skip: (ModelConfig, state_dict name) -> whether a checkpoint may omit it (a tied LM head).
        backends: ``learner.backend`` values that train it.
        init_config: (sizes, renderer) -> the config.json dict of a new random-weight folder
            (``t1async model init``; sizes in the family's config.json names, ``vocab_size`` set).
        sglang_names: the policy's (module name, tensor) pairs -> the names and layout the family's
            SGLang loader maps (its checkpoint layout), lazily, as views of the policy's tensors
            (:func:`sampler_weights`); the embedded sampler loads module names as they are.
    """

    model_type: str
    build: Callable[[ModelConfig], nn.Module]
    convert: Callable[[ModelConfig], Convert]
    skip: Callable[[ModelConfig, str], bool]
    backends: tuple[str, ...]
    init_config: Callable[[dict, object], dict]
    sglang_names: Callable[[Named], Iterator[tuple[str, torch.Tensor]]] = iter


_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")


def unfuse_experts(named: Named) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers v5's fused expert parameters as one tensor per expert, the checkpoint layout
    (the inverse of :func:`t1async.models.hf_folder.fuse_expert`): ``...mlp.experts.gate_up_proj``
    [E, 2I, H] gives ``...mlp.experts.{e}.gate_proj.weight`` = rows [0, I) of expert e and
    ``...up_proj.weight`` = rows [I, 2I) (each [I, H]); ``...mlp.experts.down_proj`` [E, H, I] gives
    ``...mlp.experts.{e}.down_proj.weight`` [H, I]. Every other pair passes as it is.

    Each yielded tensor is a contiguous view of the fused parameter (no copy), so a publish that
    packs them into buckets holds at most one bucket of extra bytes, never a second policy."""
    for name, t in named:
        m = _FUSED_EXPERTS.fullmatch(name)
        if m is None:
            yield name, t
            continue
        prefix, which = m.group(1), m.group(2)
        if which == "down_proj":
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", t[e]
            continue
        rows = t.shape[1] // 2
        for e in range(t.shape[0]):
            yield f"{prefix}.{e}.gate_proj.weight", t[e, :rows]
            yield f"{prefix}.{e}.up_proj.weight", t[e, rows:]


_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fuse_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`unfuse_experts` on a whole state dict: one tensor per expert stacked into
    ``...mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and ``...down_proj`` [E, H, I], bit for
    bit; other names as they are, in order.

    Raises:
        ValueError: a layer's experts are not numbered 0 .. E-1, or one lacks a projection.
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in sd.items():
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, by_e in experts.items():
        ids = sorted(by_e)
        if ids != list(range(len(ids))) or any(len(p) != 3 for p in by_e.values()):
            raise ValueError(f"{prefix}: experts {ids} are not 0..{len(ids) - 1}, each with gate, up and down "
                             "projections")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_e[e]["gate_proj"], by_e[e]["up_proj"]]) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([by_e[e]["down_proj"] for e in ids])
    return out


def _qwen3_build(cfg: ModelConfig) -> nn.Module:
    """Qwen3MoeForCausalLM of ``cfg``; a folder's config.json is first checked to be one it runs."""
    if cfg.hf_config:
        try:
            model_config_from_hf(text_config(cfg.hf_config))
        except ValueError as e:
            raise ModelFolderError(f"model.path={cfg.path}: {e}") from None
    return Qwen3MoeForCausalLM(cfg)


def _qwen3_convert(cfg: ModelConfig) -> Convert:
    return lambda name, t: _unfuse_experts({name: t}, cfg).items()


def _qwen3_init(sizes: dict, renderer) -> dict:
    names = {f.name for f in dataclasses.fields(ModelConfig)} - {"path", "hf_config"}
    bad = sorted(set(sizes) - names)
    if bad:
        raise ModelFolderError(f"qwen3_moe has no config key {bad[0]!r}; its keys: {', '.join(sorted(names))}")
    d = model_config_to_hf(ModelConfig(**sizes))
    d["eos_token_id"] = renderer.end_of_turn_ids[0]
    return d


def _built(cls: type[nn.Module]) -> Callable[[ModelConfig], nn.Module]:
    """``cls(cfg)``, a config it cannot run (ValueError) refused as a :class:`ModelFolderError` naming the folder."""
    def build(cfg: ModelConfig) -> nn.Module:
        try:
            return cls(cfg)
        except ValueError as e:
            raise ModelFolderError(f"model.path={cfg.path}: {e}") from None
    return build


def _tied_lm_head(cfg: ModelConfig, name: str) -> bool:
    """A tied model's checkpoint may omit ``lm_head.weight`` (it is the embedding)."""
    return cfg.tie_word_embeddings and name == "lm_head.weight"


def _qwen35_init(sizes: dict, renderer) -> dict:
    tiny = {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "shared_expert_intermediate_size": sizes.get("moe_intermediate_size", 64)}
    d = {**tiny, **sizes}
    names = {f.name for f in dataclasses.fields(Qwen35TextConfig)}
    bad = sorted(set(d) - names)
    if bad:
        raise ModelFolderError(f"qwen3_5_moe has no config key {bad[0]!r}; its keys: {', '.join(sorted(names))}")
    n = int(d.get("num_hidden_layers", 2))
    if not d.get("layer_types"):  # one full-attention layer in four, the last layer full in a short model
        d["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 or i == n - 1 else "linear_attention" for i in range(n)]
    try:
        c = qwen35_config_from_hf(d)
    except ValueError as e:
        raise ModelFolderError(f"qwen3_5_moe: {e}") from None
    out = qwen35_config_to_hf(c)
    out["eos_token_id"] = renderer.end_of_turn_ids[0]
    return out


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _glm4_convert(cfg: ModelConfig) -> Convert:
    """GLM-4.5/4.6 checkpoint tensors onto transformers' modules: per-expert tensors fused
    (:func:`t1async.models.hf_folder.fuse_expert`); the multi-token-prediction layers that released checkpoints
    carry after the decoder (indices ``num_hidden_layers`` .. ``+ num_nextn_predict_layers - 1``, e.g.
    ``model.layers.46.*`` of GLM-4.5-Air's 46) map to nothing: transformers does not build them (its
    ``_keys_to_ignore_on_load_unexpected``), training leaves them as they are, and a checkpoint carries them through
    unchanged (:func:`t1async.models.hf_folder.source_layout`), as SGLang and vLLM serve them for speculative
    decoding. Any other layer index past the decoder stays unexpected (refused)."""
    t = decoder_config(cfg.hf_config) if cfg.hf_config else {}
    first = cfg.num_hidden_layers
    mtp = int(t.get("num_nextn_predict_layers", t.get("num_mtp_layers", 1)) or 0)

    def convert(name: str, tensor: torch.Tensor):
        m = _LAYER.match(name)
        if m is not None and first <= int(m.group(1)) < first + mtp:
            return ()
        return fuse_expert(name, tensor)
    return convert


def _glm4_init(sizes: dict, renderer) -> dict:
    from transformers import Glm4MoeConfig  # (transformers: deferred, heavy)

    d = {"n_routed_experts": sizes.pop("num_experts", 4), "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
         "first_k_dense_replace": 1, "intermediate_size": 2 * sizes.get("moe_intermediate_size", 64),
         "attention_dropout": 0.0, **sizes}
    try:
        c = Glm4MoeConfig(**d)
        hf_generic_config(c.to_dict())
    except (TypeError, ValueError) as e:
        raise ModelFolderError(f"glm4_moe: {e}") from None
    out = hf_generic_config_to_hf(c)
    out["eos_token_id"] = renderer.end_of_turn_ids
    return out


FAMILIES: dict[str, Family] = {
    "glm4_moe": Family("glm4_moe", _built(HFMoeForCausalLM), _glm4_convert, _tied_lm_head, ("torch", "megatron"),
                       _glm4_init, unfuse_experts),
    "qwen3_5_moe": Family("qwen3_5_moe", _built(Qwen3_5MoeForCausalLM), qwen35_hf_convert, _tied_lm_head,
                          ("torch", "megatron"), _qwen35_init),
    "qwen3_moe": Family("qwen3_moe", _qwen3_build, _qwen3_convert, _tied_lm_head, ("torch", "megatron"),
                        _qwen3_init),
}
"""The families t1async implements, by ``model_type``."""

SAMPLER_SKIPS: dict[str, dict[str, re.Pattern]] = {
    "sglang": {"qwen3_moe": _FUSED_EXPERTS, "glm4_moe": _FUSED_EXPERTS},
}
"""Per sampler backend and ``model_type``: the parameter names that backend's weight loader maps to
nothing and skips without an error. SGLang 0.5.10.post1's ``Qwen3MoeForCausalLM`` and
``Glm4MoeForCausalLM.load_weights`` map routed experts only by per-expert names
(``experts.{e}.gate_proj.`` ...; ``FusedMoE.make_expert_params_mapping``), so fused
``mlp.experts.gate_up_proj`` / ``down_proj`` are skipped; its Qwen3.5 loader maps the fused names too.
tests/contracts/test_sglang_loaders.py holds this table to the pinned wheel's own ``load_weights``."""


def sampler_weights(cfg: ModelConfig, named: Named, sampler_backend: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's (module name, tensor) pairs as ``sampler_backend`` loads them: the embedded sampler
    takes module names as they are; SGLang the family's checkpoint names and layout
    (:attr:`Family.sglang_names`; glm4_moe: one tensor per expert). Lazy: views, one at a time.

    Raises:
        ModelFolderError: an unknown family or sampler backend.
    """
    fam = family(cfg)
    if sampler_backend == "embedded":
        return iter(named)
    if sampler_backend == "sglang":
        return fam.sglang_names(named)
    raise ModelFolderError(f"sampler.backend={sampler_backend!r}: use 'embedded' or 'sglang'")


def check_sampler_names(cfg: ModelConfig, sampler_backend: str) -> int:
    """Refuse a family whose published names ``sampler_backend``'s loader would skip (:data:`SAMPLER_SKIPS`):
    the servers would keep their initial weights while the version moves on. The names come from the model
    built on the meta device (no memory) through :func:`sampler_weights`, as a publish sends them.

    Returns:
        how many names a publish sends.

    Raises:
        ModelFolderError: one line naming the family, the first skipped name and what to do.
    """
    skips = SAMPLER_SKIPS.get(sampler_backend, {}).get(cfg.model_type)
    with torch.device("meta"):
        meta = family(cfg).build(cfg)
    names = [n for n, _ in sampler_weights(cfg, meta.named_parameters(), sampler_backend)]
    bad = [n for n in names if skips is not None and skips.fullmatch(n)]
    if bad:
        raise ModelFolderError(f"sampler.backend={sampler_backend} with model_type {cfg.model_type}: its weight loader "
                               f"skips {len(bad)} of the {len(names)} published names (e.g. {bad[0]}), so the servers "
                               "would keep their initial weights; use sampler.backend=embedded, or publish this family "
                               "in its checkpoint layout (Family.sglang_names in t1async/models/families.py)")
    return len(names)


def family(cfg: ModelConfig, backend: str | None = None) -> Family:
    """The :class:`Family` of ``cfg.model_type``.

    Args:
        cfg: the run's model section.
        backend: a learner backend that must run it (None: any).

    Raises:
        ModelFolderError: no implementation of that model_type (the message lists those there are), or
            ``backend`` does not run it (the message names the backends that do).
    """
    fam = FAMILIES.get(cfg.model_type)
    if fam is None:
        have = ", ".join(sorted(FAMILIES))
        raise ModelFolderError(f"model.path={cfg.path}: model_type {cfg.model_type!r} has no implementation in this "
                               f"build (implemented: {have}; known: {', '.join(MODEL_TYPES)})")
    if backend is not None and backend not in fam.backends:
        raise ModelFolderError(f"learner.backend={backend} does not run model_type {cfg.model_type} (model.path="
                               f"{cfg.path}); use learner.backend={fam.backends[0]}")
    return fam


def build_model(cfg: ModelConfig) -> nn.Module:
    """A model of ``cfg``'s family and architecture with fresh weights (float32; the caller seeds torch)."""
    return family(cfg).build(cfg)


def load_model(cfg: ModelConfig, folder: str | Path | None = None) -> nn.Module:
    """The model of ``cfg``'s architecture with the weights of ``folder`` (default ``cfg.path``), streamed.
    Checkpoint tensors of parts the family does not build (an MTP layer, a vision tower) are not loaded, and one
    warning per process names them (:func:`warn_left_out`).

    Raises:
        ModelFolderError: as :func:`t1async.models.hf_folder.load_weights` (weights named), or no folder.
    """
    folder = folder or cfg.path
    if not folder:
        raise ModelFolderError("load_model needs a folder: model.path is empty")
    fam = family(cfg)
    model = fam.build(cfg)
    load_weights(model, folder, convert=fam.convert(cfg), skip=lambda name: fam.skip(cfg, name))
    warn_left_out(folder, weight_specs(folder), fam.convert(cfg))
    return model


_warned_left_out: set[tuple] = set()
"""(folder, groups) already warned about by :func:`warn_left_out`."""


def warn_left_out(folder: str | Path, specs: dict, convert: Convert) -> dict[str, int]:
    """Log once per folder and process which checkpoint tensors the model does not load
    (:func:`t1async.models.hf_folder.left_out`: group -> count); returns them."""
    groups = left_out(specs, convert)
    key = (str(folder), tuple(groups.items()))
    if groups and key not in _warned_left_out:
        _warned_left_out.add(key)
        listed = ", ".join(f"{g} ({n} tensor{'s' if n > 1 else ''})" for g, n in groups.items())
        logger.warning("model folder {}: not loaded (parts this family does not build for RL on text): {}; "
                       "checkpoints carry them through unchanged", folder, listed)
    return groups


def _weights_source(cfg: ModelConfig, out: str | Path | None = None) -> Path | None:
    """``cfg.path`` when it holds weights (and is not ``out``): the folder whose layout checkpoints keep."""
    if not cfg.path:
        return None
    src = Path(cfg.path)
    if out is not None and src.resolve() == Path(out).resolve():
        return None
    return src if (src / WEIGHTS).is_file() or (src / WEIGHTS_INDEX).is_file() else None


def save_model(out: str | Path, cfg: ModelConfig, weights: nn.Module | dict[str, torch.Tensor], *,
               max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write a model (or its ``state_dict``) as a model folder of ``cfg``'s family.

    A model loaded from a folder (``cfg.path`` holds weights) is written in that folder's layout: its config.json
    unchanged, its tensor names and prefixes (a multimodal checkpoint's ``model.language_model.``), its expert
    layout (per expert or fused), each tensor in its dtype (a bfloat16 folder gives a bfloat16 checkpoint: see
    :func:`checkpoint_rounds`), and the tensors the model does not build (vision tower, MTP layers) carried through
    from it unchanged (:func:`t1async.models.hf_folder.source_layout`); its tokenizer files are copied. So the class
    its config.json names, SGLang and vLLM load the checkpoint as they loaded the source.

    A model without a source folder (built from sizes, ``t1async model init``) is written by
    :func:`t1async.models.model.save_hf` in its own dtype: the transformers-backed families in transformers'
    checkpoint layout (``checkpoint_state_dict``: one tensor per expert)."""
    fam = family(cfg)
    source = _weights_source(cfg, out)
    if source is not None:
        state = weights.state_dict() if isinstance(weights, nn.Module) else weights
        return save_folder(out, source_layout(source, state, fam.convert(cfg)), read_config(source),
                           max_shard_bytes=max_shard_bytes, source=source)
    if isinstance(weights, nn.Module):
        weights = weights.checkpoint_state_dict() if hasattr(weights, "checkpoint_state_dict") else weights.state_dict()
    return save_hf(out, cfg, weights, max_shard_bytes=max_shard_bytes)


def checkpoint_rounds(cfg: ModelConfig, model: nn.Module | Iterable[torch.Tensor]) -> bool:
    """Whether :func:`save_model` writes some of ``model``'s parameters (or these tensors) in a narrower dtype than
    they are held in (a float32 learner of a bfloat16 folder): the caller then keeps its own weights too (in its
    optimiser state), so that a resume restores them exactly."""
    source = _weights_source(cfg)
    if source is None:
        return False
    sizes = [d.itemsize for _, d, _ in weight_specs(source).values() if d.is_floating_point]
    tensors = model.parameters() if isinstance(model, nn.Module) else model
    return bool(sizes) and any(p.dtype.itemsize > min(sizes) for p in tensors if p.is_floating_point())


def _parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def check_model_folder(cfg: ModelConfig, *, backend: str | None = None, tokenizer: bool = True,
                       available: int | None = None) -> dict:
    """Every check of ``model.path`` that can run before a weight is read.

    - the family runs on ``backend``;
    - the weights: shards readable and complete, names and shapes those of the architecture (a model built
      on the meta device, no memory), each fault named;
    - memory: the float32 model fits what this machine has available (:func:`hf_folder.check_memory`);
    - with ``tokenizer``: the tokenizer files load, the template renders a prompt with a tool and a tool
      observation turn, and the tokenizer's ids fit the embedding.

    Returns:
        facts for the log: ``parameters``, ``weight_bytes``, ``vocab`` (the tokenizer's size, when checked).

    Raises:
        ModelFolderError: one line naming the folder, the fault and the fix.
    """
    fam = family(cfg, backend)
    with torch.device("meta"):
        meta = fam.build(cfg)
    n = _parameters(meta)
    check_memory(cfg.path, n, available=available)
    specs = check_model_weights(meta, cfg.path, fam.convert(cfg), lambda name: fam.skip(cfg, name))
    warn_left_out(cfg.path, specs, fam.convert(cfg))
    facts = {"parameters": n, "weight_bytes": sum(torch.empty(s, dtype=d, device="meta").nbytes
                                                 for s, d, _ in specs.values())}
    if tokenizer:
        r = load_renderer(cfg)
        facts["vocab"] = r.vocab_size
        if r.vocab_size > cfg.vocab_size:
            raise ModelFolderError(f"model.path={cfg.path}: the tokenizer has {r.vocab_size} ids but the embedding only "
                                   f"{cfg.vocab_size} rows (config.json vocab_size); the tokenizer files and the weights "
                                   "must come from the same model")
    return facts


def load_renderer(cfg: ModelConfig):
    """The run's episode renderer: ``cfg.path``'s own chat template, checked to render a tool prompt and a
    tool observation (:class:`t1async.models.chat_template.ChatTemplateRenderer`), or the shipped ChatML
    tokenizer (:class:`t1async.models.tokenizer.ChatTokenizer`) for the built-in model. ``cfg.chat_template_kwargs``
    go to every rendering of the template: every render site (rollout, sft, eval, the endpoint, model check)
    takes its renderer from here.

    Raises:
        ModelFolderError: the folder's tokenizer files are missing or its template cannot render a tool turn.
    """
    if not cfg.path:
        return ChatTokenizer.load()
    try:
        r = ChatTemplateRenderer.load(cfg.path, cfg.chat_template_kwargs)
        probe = {"name": "bash", "description": "Run a shell command.",
                 "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
        r.render_prompt("system", "user", [probe])
        r.render_observation([{"role": "system", "content": "system"}, {"role": "user", "content": "user"},
                              {"role": "assistant", "content": "ls"}], "output", [probe])
    except TemplateError as e:
        raise ModelFolderError(f"model.path={cfg.path}: {e}") from None
    return r
