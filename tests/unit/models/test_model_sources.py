"""Model folders written by transformers itself (issue 41, items 7-10): each folder here is a tiny random model
built from transformers' own config class and written by its ``save_pretrained`` (plus, for GLM's MTP layer,
the tensors released checkpoints carry and transformers does not write), never by ``t1async model init``, so
the tests see what users' files hold: the config names of the installed transformers, its checkpoint layout
(one tensor per expert), a multimodal wrapper's prefixes and vision tower, bfloat16 weights.

A checkpoint is checked the way its users read it: loaded by the class its own config.json names, every
tensor compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from t1async.config import ConfigError, GenerationConfig, LearnerConfig, ModelConfig
from t1async.config.model_folder import FIELD_NAMES, resolve_model
from t1async.models import families
from t1async.models.families import check_model_folder, checkpoint_rounds, load_model, save_model
from t1async.models.hf_folder import ModelFolderError

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _save(model, out: Path, dtype=torch.float32) -> Path:
    model.to(dtype).save_pretrained(str(out))
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    for name in files:
        with safe_open(str(folder / name), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _cfg(folder: Path) -> ModelConfig:
    return resolve_model(ModelConfig(path=str(folder)))


def _perturb(model: torch.nn.Module, seed: int = 5) -> None:
    """Move every parameter (as a training step would), so a checkpoint must write the model's values back."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


def _by_config_class(folder: Path) -> torch.nn.Module:
    """The checkpoint loaded as its users load it: the class its own config.json names."""
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(str(folder), dtype=torch.float32)


def _ids(vocab: int, T: int = 12, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- 7: config names per transformers version

QWEN3 = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=16,
             max_position_embeddings=256)


def test_the_field_names_table_covers_every_alias_of_transformers_config_classes():
    """Every ``attribute_map`` entry of the families' config classes that touches a ModelConfig field (under any
    of its names) has both its names in FIELD_NAMES, and the name ``to_dict`` writes is among them: a future
    rename in transformers fails here instead of silently falling back to a default."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    classes = {"qwen3_moe": transformers.Qwen3MoeConfig, "glm4_moe": transformers.Glm4MoeConfig,
               "qwen3_5_moe": Qwen3_5MoeTextConfig}
    for family, cls in classes.items():
        names = FIELD_NAMES.get(family, {})
        for alias, real in cls.attribute_map.items():
            for field, known in names.items():
                if alias in known or real in known:
                    assert {alias, real} <= set(known), (family, alias, real, known)
        written = cls(num_experts_per_tok=2).to_dict()
        experts = names.get("num_experts", ("num_experts",))
        assert any(written.get(n) is not None for n in experts), (family, sorted(written))


def test_a_qwen3_moe_folder_saved_by_transformers_loads_its_16_experts(tmp_path):
    """transformers 5.25 writes ``num_local_experts``; the folder loads with its 16 experts (not the default 8,
    refused as 'config.json says 8'), with transformers' logits; the older name loads alike, and a file with both
    names disagreeing is refused in one line naming both."""
    torch.manual_seed(0)
    src = _save(transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**QWEN3)), tmp_path / "q")
    written = json.loads((src / "config.json").read_text())
    assert written.get("num_local_experts", written.get("num_experts")) == 16
    cfg = _cfg(src)
    assert cfg.num_experts == 16
    check_model_folder(cfg, tokenizer=False)
    ours = load_model(cfg).eval()
    ref = _by_config_class(src).eval()
    ids = _ids(256)
    with torch.no_grad():
        diff = (ours(ids).logits.log_softmax(-1) - ref(ids).logits.log_softmax(-1)).abs().max()
    assert float(diff) <= 1e-5
    old = {k: v for k, v in written.items() if k != "num_local_experts"} | {"num_experts": 16}
    (src / "config.json").write_text(json.dumps(old))
    assert _cfg(src).num_experts == 16
    (src / "config.json").write_text(json.dumps(old | {"num_local_experts": 8}))
    with pytest.raises(ConfigError, match="num_experts=16, num_local_experts=8"):
        _cfg(src)


# ----------------------------------------------------------------------------- 8: GLM's MTP layer

GLM = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
           n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, num_nextn_predict_layers=1,
           max_position_embeddings=256, attention_dropout=0.0)


def _glm_with_mtp(folder: Path) -> tuple[Path, list[str]]:
    """A GLM-4.5-shaped folder: transformers' save_pretrained of a 2-layer model, plus what released checkpoints
    carry after the decoder and transformers does not write: the MTP layer ``model.layers.2.*`` (a whole decoder
    layer with its experts, and ``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm``)."""
    torch.manual_seed(0)
    _save(transformers.AutoModelForCausalLM.from_config(transformers.Glm4MoeConfig(**GLM)), folder, torch.bfloat16)
    sd = _tensors(folder)
    g = torch.Generator().manual_seed(9)
    mtp = {k.replace("model.layers.1.", "model.layers.2.", 1): torch.randn(v.shape, generator=g).to(v.dtype)
           for k, v in sd.items() if k.startswith("model.layers.1.")}
    mtp["model.layers.2.eh_proj.weight"] = torch.randn(32, 64, generator=g).bfloat16()
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.2.{norm}.weight"] = torch.ones(32).bfloat16()
    save_file({**sd, **mtp}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, sorted(mtp)


def test_a_glm_folder_with_its_mtp_layer_loads_the_decoder_and_its_checkpoint_carries_the_mtp_layer(tmp_path):
    """The MTP layer (index = num_hidden_layers) is not loaded, one warning names it and its count; the decoder
    is transformers' own (same logits as transformers, which skips those tensors too); the checkpoint holds the
    MTP tensors byte for byte and the decoder's trained values, per expert, in bfloat16 as the source; a layer
    past the declared MTP layers is still refused."""
    src, mtp = _glm_with_mtp(tmp_path / "glm")
    cfg = _cfg(src)
    seen: list[str] = []
    sink = families.logger.add(lambda m: seen.append(str(m)), level="WARNING")
    try:
        ours = load_model(cfg)
    finally:
        families.logger.remove(sink)
    assert [s for s in seen if "model.layers.2.*" in s and f"({len(mtp)} tensors)" in s], seen
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ids = _ids(256)
    with torch.no_grad():
        assert torch.equal(ours.eval()(ids).logits.log_softmax(-1), ref(ids).logits.float().log_softmax(-1))
    _perturb(ours)
    save_model(tmp_path / "ckpt", cfg, ours)
    source, ckpt = _tensors(src), _tensors(tmp_path / "ckpt")
    assert ckpt.keys() == source.keys() and "model.layers.1.mlp.experts.3.down_proj.weight" in ckpt
    assert all(ckpt[k].dtype == torch.bfloat16 for k in ckpt if source[k].dtype == torch.bfloat16)
    assert all(torch.equal(ckpt[k], source[k]) for k in mtp)
    back = load_model(_cfg(tmp_path / "ckpt"))
    want = {k: v.bfloat16().float() for k, v in ours.state_dict().items()}
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items())
    stray = {**source, "model.layers.3.enorm.weight": torch.ones(32).bfloat16()}
    save_file(stray, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match="1 unexpected: model.layers.3.enorm.weight"):
        check_model_folder(_cfg(src), tokenizer=False)


# ----------------------------------------------------------------------------- 9: qwen3_5_moe in the source's layout

QWEN35 = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
              num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], max_position_embeddings=256)


def _qwen35(folder: Path, multimodal: bool, dtype=torch.float32) -> Path:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    if multimodal:
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=32)
        model = transformers.Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=QWEN35,
                                                                                 vision_config=vision))
    else:
        model = transformers.Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**QWEN35))
    return _save(model, folder, dtype)


@pytest.mark.parametrize("multimodal", [False, True], ids=["per-expert", "multimodal"])
def test_a_qwen3_5_moe_checkpoint_is_written_in_its_source_layout(tmp_path, multimodal):
    """The checkpoint of a folder transformers wrote (one tensor per expert; for the multimodal wrapper, text
    weights under ``model.language_model.`` and a vision tower) has the source's names and config.json; loaded by
    the class that config.json names, every text-decoder tensor is the trained model's and every vision tensor
    the source's, and its logits are ours."""
    src = _qwen35(tmp_path / "src", multimodal)
    cfg = _cfg(src)
    ours = load_model(cfg)
    _perturb(ours)
    save_model(tmp_path / "ckpt", cfg, ours)
    source, ckpt = _tensors(src), _tensors(tmp_path / "ckpt")
    assert ckpt.keys() == source.keys()
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    loaded = _by_config_class(tmp_path / "ckpt")
    mine = ours.state_dict()
    text = "model.language_model." if multimodal else "model."
    compared = 0
    for name, t in loaded.state_dict().items():
        if name.startswith("model.visual."):
            assert torch.equal(t, source[name]), name
        else:
            key = name.replace(text, "model.", 1)
            assert torch.equal(t, mine[key]), name
        compared += 1
    assert compared == len(loaded.state_dict()) and (not multimodal or any(".visual." in k for k in ckpt))
    ids = _ids(256)
    with torch.no_grad():
        ref = loaded.eval()(input_ids=ids).logits
        diff = (ours.eval()(ids).logits.log_softmax(-1) - ref.log_softmax(-1)).abs().max()
    assert float(diff) <= 1e-4


# ----------------------------------------------------------------------------- 10: the source's dtype, float32 masters

def test_a_bfloat16_folder_gives_a_bfloat16_checkpoint(tmp_path):
    src = _qwen35(tmp_path / "src", multimodal=False, dtype=torch.bfloat16)
    cfg = _cfg(src)
    ours = load_model(cfg)
    assert checkpoint_rounds(cfg, ours)
    save_model(tmp_path / "ckpt", cfg, ours)
    ckpt = _tensors(tmp_path / "ckpt")
    assert {t.dtype for t in ckpt.values()} == {torch.bfloat16}
    assert (tmp_path / "ckpt" / "model.safetensors").stat().st_size <= 1.01 * (src / "model.safetensors").stat().st_size
    assert all(torch.equal(ckpt[k], v) for k, v in _tensors(src).items())  # untrained: the same bits back


def _step(backend, ids: torch.Tensor) -> None:
    fwd = backend.policy_logprobs(ids, torch.roll(ids, -1, 1), None, grad=True, routing=False)
    backend.zero_grad()
    backend.backward(-fwd.logp.mean())
    backend.step(policy=True, policy_lr=1e-3)


def test_a_resume_from_a_bfloat16_checkpoint_continues_the_float32_weights_exactly(tmp_path):
    """A torch learner of a bfloat16 folder trains in float32; its checkpoint is bfloat16 (the source's dtype)
    and keeps the float32 policy in its optimiser state, so a resumed learner's next step gives bitwise the
    weights of the uninterrupted run (as the other resume tests hold weights bitwise)."""
    from t1async.learner.torch_backend import TorchBackend

    torch.manual_seed(0)
    src = _save(transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**QWEN3)), tmp_path / "q",
                torch.bfloat16)
    cfg = _cfg(src)
    ids = _ids(256, 16)
    torch.manual_seed(1)
    run = TorchBackend(LearnerConfig(), cfg, GenerationConfig(), None)
    _step(run, ids)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run.save(ckpt)
    assert {t.dtype for t in _tensors(ckpt).values()} == {torch.bfloat16}
    _step(run, ids)
    torch.manual_seed(1)
    resumed = TorchBackend(LearnerConfig(), cfg, GenerationConfig(), ckpt)
    assert resumed.load_state(ckpt) is True
    _step(resumed, ids)
    want = dict(run.policy.named_parameters())
    for name, p in resumed.policy.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, want[name]), name


# ----------------------------------------------------------------------------- 11: refusals docs/models.md lists

@pytest.mark.parametrize("change,fault", [
    ({"mlp_only_layers": [0]}, "dense layers"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                          "original_max_position_embeddings": 64}}, "RoPE scaling"),
], ids=["dense-layer", "rope-scaling"])
def test_a_qwen3_moe_folder_with_a_dense_layer_or_rope_scaling_is_refused_in_one_line(tmp_path, change, fault):
    """What t1async's Qwen3-MoE does not run, in a folder transformers wrote, is refused before a weight is read
    (the launch's pre-flight check), one line naming the folder and the fault."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**QWEN3, **change))
    src = _save(model, tmp_path / "q")
    with pytest.raises(ModelFolderError, match=fault) as e:
        check_model_folder(_cfg(src), tokenizer=False)
    assert str(src) in str(e.value) and "\n" not in str(e.value)
