"""The names a publish sends to SGLang servers are names the pinned SGLang release's own ``load_weights``
maps, for every family: run the wheel's loader over what we publish and fail on any name it skips.

SGLang cannot be imported here (its model files need CUDA-only packages), so the test reads the pinned
wheel itself (downloaded by ``pip download --no-deps``, tests/support/sglang_schema.py, cached outside the
repository; skipped with the reason when the index cannot be reached) and executes, unchanged, the
``load_weights`` method of the class our config.json names in ``architectures`` (plus the two helpers it
calls, ``FusedMoE.make_expert_params_mapping`` and ``get_layer_id``, also taken from the wheel). Only
the parameters are stand-ins: each records ``(parameter, shard_id, expert_id) -> tensor`` when a weight
loader is called.

Which parameters does an SGLang model have? Those its loader fills from the family's real checkpoint:
pass 1 runs the loader over transformers' own ``save_pretrained`` of the model (a dict that accepts every
name), and the parameters it touched are the model's. Pass 2 runs it over :func:`sampler_weights` with
exactly those parameters: a name that reaches no weight loader is skipped (the silent bug of issue 40),
and every piece pass 1 loaded must be loaded again with an equal tensor (so gate/up order and shapes are
the checkpoint's too).
"""

from __future__ import annotations

import ast
import json
import logging
import re
import textwrap
import typing
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from t1async.config import ModelConfig
from t1async.config.model_folder import resolve_model, text_config
from t1async.models.families import (
    FAMILIES,
    SAMPLER_SKIPS,
    ModelFolderError,
    build_model,
    check_sampler_names,
    family,
    sampler_weights,
    save_model,
)
from t1async.models.tokenizer import ChatTokenizer
from tests.support import REPO
from tests.support import sglang_schema as schema_tool

ROOT = REPO

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    try:
        path = schema_tool.download(schema_tool.PINNED_VERSION)
    except schema_tool.SchemaError as e:
        if "Could not find a version" in str(e) or "No matching distribution" in str(e):
            raise  # the index answered: the pinned release is gone, a real failure
        pytest.skip(f"package index unreachable, cannot fetch the pinned SGLang wheel: {e}")
    with zipfile.ZipFile(path) as z:
        yield z


def _function(source: str, name: str, cls: str | None = None) -> str:
    """The source text of function ``name`` (a method of ``cls`` when given) in ``source``, dedented."""
    tree = ast.parse(source)
    scope = tree.body
    if cls is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next((n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:
        raise LookupError(f"{cls + '.' if cls else ''}{name} not in the source")
    return textwrap.dedent(ast.get_source_segment(source, node))


class _Param:
    """A parameter stand-in: its weight loader records what each call would load."""

    def __init__(self, name: str, log: dict):
        self.name, self._log = name, log

    def weight_loader(self, param, loaded, *args, **kw):
        shard = kw.get("shard_id", args[0] if len(args) == 1 else args[1] if len(args) >= 2 else None)
        expert = kw.get("expert_id", args[2] if len(args) >= 3 else None)
        self._log["pieces"][(self.name, str(shard), expert)] = loaded
        self._log["loaded"].add(self._log["current"])


class _AcceptAll(dict):
    """Pass 1's parameter dict: every name the loader asks for exists (and is then recorded)."""

    def __init__(self, log: dict):
        super().__init__()
        self._log = log

    def __contains__(self, name):
        return True

    def __missing__(self, name):
        self[name] = p = _Param(name, self._log)
        return p

    def keys(self):
        return self


def _loader(wheel: zipfile.ZipFile, arch: str):
    """The wheel's ``ARCH.load_weights``, as a function of ``(self, weights)``, and the log it writes into."""
    models = [n for n in wheel.namelist() if n.startswith("sglang/srt/models/") and n.endswith(".py")]
    owner = [n for n in models if re.search(rf"^class {arch}\(", wheel.read(n).decode(), re.M)]
    assert owner, f"the pinned SGLang wheel defines no model class {arch}"
    src = _function(wheel.read(owner[0]).decode(), "load_weights", arch)
    moe = wheel.read("sglang/srt/layers/moe/fused_moe_triton/layer.py").decode()
    mapping = _function(moe, "make_expert_params_mapping", "FusedMoE")
    layer_id = _function(wheel.read("sglang/srt/layers/utils/common.py").decode(), "get_layer_id")
    log: dict = {"pieces": {}, "loaded": set(), "current": None, "params": None}

    def default_weight_loader(param, loaded):
        param.weight_loader(param, loaded)

    ns = {"torch": torch, "re": re, "logger": logging.getLogger("sglang-stand-in"), "LazyValue": lambda f: None,
          "default_weight_loader": default_weight_loader, **{k: getattr(typing, k) for k in typing.__all__}}
    exec("class FusedMoE:\n    @classmethod\n" + textwrap.indent(mapping, "    "), ns)
    exec(layer_id, ns)
    exec(src, ns)
    ns["dict"] = lambda items=(): log["params"] if log["params"] is not None else _AcceptAll(log)
    return ns["load_weights"], log


def _run(wheel, arch: str, config: dict, named, params: dict | None = None) -> dict:
    """Run the wheel's loader over ``named``; returns its log: ``pieces``, ``loaded`` names, ``params``."""
    fn, log = _loader(wheel, arch)
    log["params"] = None if params is None else {k: _Param(k, log) for k in params}
    owner = SimpleNamespace(config=SimpleNamespace(**config), num_fused_shared_experts=0, model=SimpleNamespace(),
                            named_parameters=lambda remove_duplicate=True: ())

    def weights():
        for name, t in named:
            log["current"] = name
            yield name, t
    fn(owner, weights())
    if params is None:
        log["params"] = {k for k, _, _ in log["pieces"]}
    return log


def _tiny(family_name: str, folder: Path) -> tuple[ModelConfig, torch.nn.Module]:
    renderer = ChatTokenizer.load()
    d = FAMILIES[family_name].init_config({**SIZES, "vocab_size": renderer.vocab_size}, renderer)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    cfg = resolve_model(ModelConfig(path=str(folder)))
    torch.manual_seed(0)
    return cfg, build_model(cfg)


def _transformers_checkpoint(cfg: ModelConfig, model, tmp: Path) -> dict[str, torch.Tensor]:
    """What transformers' own ``save_pretrained`` writes for ``model``'s weights (its buffers left out: they are
    not trained and not published), read back from the safetensors file."""
    from transformers import AutoModelForCausalLM

    ours = tmp / "ours"
    save_model(ours, cfg, model)
    hf = AutoModelForCausalLM.from_pretrained(str(ours), dtype=torch.float32)
    hf.save_pretrained(str(tmp / "hf"))
    buffers = {n for n, _ in hf.named_buffers()}
    out = {}
    for f in sorted((tmp / "hf").glob("*.safetensors")):
        out.update({k: v for k, v in load_file(str(f)).items() if k not in buffers})
    return out


@pytest.mark.parametrize("family_name", ["qwen3_moe", "qwen3_5_moe", "glm4_moe"])
def test_sglang_own_loader_maps_every_published_name(wheel, family_name, tmp_path):
    cfg, model = _tiny(family_name, tmp_path / "folder")
    arch = cfg.hf_config["architectures"][0]
    config = text_config(cfg.hf_config)
    reference = _run(wheel, arch, config, _transformers_checkpoint(cfg, model, tmp_path).items())
    assert reference["pieces"], "the wheel's loader loaded nothing from transformers' checkpoint"
    published = list(sampler_weights(cfg, model.named_parameters(), "sglang"))
    got = _run(wheel, arch, config, published, reference["params"])
    skipped = [n for n, _ in published if n not in got["loaded"]]
    assert not skipped, f"SGLang's {arch}.load_weights skips {len(skipped)} published names, e.g. {skipped[:3]}"
    assert set(got["pieces"]) == set(reference["pieces"]), "published names leave SGLang parameters un-updated"
    for key, t in reference["pieces"].items():
        assert torch.equal(got["pieces"][key], t), f"{key}: the published tensor differs from the checkpoint's"


@pytest.mark.parametrize("family_name", ["qwen3_moe", "qwen3_5_moe", "glm4_moe"])
def test_skip_table_agrees_with_the_wheel_on_both_layouts(wheel, family_name, tmp_path):
    """SAMPLER_SKIPS (what the launch's pre-flight refuses) says "skipped" exactly where the wheel's loader
    skips: on the names we publish and on the module names (transformers v5's fused experts)."""
    cfg, model = _tiny(family_name, tmp_path / "folder")
    arch = cfg.hf_config["architectures"][0]
    config = text_config(cfg.hf_config)
    params = _run(wheel, arch, config, _transformers_checkpoint(cfg, model, tmp_path).items())["params"]
    skips = SAMPLER_SKIPS["sglang"].get(family_name)
    for layout in (list(sampler_weights(cfg, model.named_parameters(), "sglang")), list(model.named_parameters())):
        got = _run(wheel, arch, config, layout, params)
        for name, _ in layout:
            table = bool(skips is not None and skips.fullmatch(name))
            assert table == (name not in got["loaded"]), f"{family_name} {name}: table skip={table}, wheel disagrees"


def test_glm4_module_names_are_what_the_wheel_skips(wheel, tmp_path):
    """The bug itself: transformers' fused expert parameters reach no weight loader of Glm4MoeForCausalLM."""
    cfg, model = _tiny("glm4_moe", tmp_path / "folder")
    params = _run(wheel, "Glm4MoeForCausalLM", cfg.hf_config,
                  _transformers_checkpoint(cfg, model, tmp_path).items())["params"]
    got = _run(wheel, "Glm4MoeForCausalLM", cfg.hf_config, list(model.named_parameters()), params)
    skipped = {n for n, _ in model.named_parameters() if n not in got["loaded"]}
    assert skipped == {n for n, _ in model.named_parameters() if ".mlp.experts." in n} and skipped


def test_glm4_publish_is_views_in_checkpoint_layout(tmp_path):
    """The sglang layout of glm4_moe equals transformers' checkpoint (names and values), and every tensor is a
    view of a policy parameter: a publish adds at most one bucket of bytes, never a second policy."""
    cfg, model = _tiny("glm4_moe", tmp_path / "folder")
    published = dict(sampler_weights(cfg, model.named_parameters(), "sglang"))
    checkpoint = model.checkpoint_state_dict()
    buffers = {n for n, _ in model.hf.named_buffers()}  # the router's score-correction bias: not trained
    assert published.keys() == checkpoint.keys() - buffers
    for name, t in published.items():
        assert torch.equal(checkpoint[name], t), name
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(t.untyped_storage().data_ptr() in storages and t.is_contiguous() for t in published.values())
    embedded = list(sampler_weights(cfg, model.named_parameters(), "embedded"))
    assert [n for n, _ in embedded] == [n for n, _ in model.named_parameters()]


def test_preflight_refuses_a_family_whose_published_names_sglang_skips(tmp_path, monkeypatch):
    cfg, _ = _tiny("glm4_moe", tmp_path / "folder")
    assert check_sampler_names(cfg, "sglang") > 0 and check_sampler_names(cfg, "embedded") > 0
    monkeypatch.setitem(FAMILIES, "glm4_moe", FAMILIES["glm4_moe"].__class__(
        **{**family(cfg).__dict__, "sglang_names": iter}))  # the layout before the fix: module names
    with pytest.raises(ModelFolderError) as e:
        check_sampler_names(cfg, "sglang")
    assert "mlp.experts" in str(e.value) and "\n" not in str(e.value)
