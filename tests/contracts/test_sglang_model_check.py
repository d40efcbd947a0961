"""One model for learner and SGLang servers: servers start from ``model.path`` (or the resumed checkpoint),
and each server, started or attached, is refused in one line when its model type, vocabulary, end ids
or weight names differ from the learner's (the fake SGLang server reports them from the folder it fakes)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from t1async.config import ConfigError, SamplerConfig
from t1async.learner.checkpoints import write_manifest
from t1async.sampling.server_check import check_servers, folder_facts, probe_names
from t1async.sampling.sglang_server import start_servers, stop_servers
from t1async.service.launch import sglang_model_dir
from t1async.service.preflight import check_sglang_model_path
from tests.support import TESTS
from tests.support.sglang_fake import FakeSGLangServer, folder_shape

PKG = TESTS / "fake_sglang_pkg"


def _names(layers: int, tied: bool = False) -> list[str]:
    out = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    for i in range(layers):
        out += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.self_attn.q_proj.weight",
                f"model.layers.{i}.mlp.experts.0.gate_proj.weight"]
    return out


def _folder(path: Path, *, vocab: int = 512, eos=(7, 9), layers: int = 2, model_type: str = "qwen3_moe") -> Path:
    """A model folder's metadata: config.json, generation_config.json, the safetensors index (no tensors)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": model_type, "vocab_size": vocab, "num_hidden_layers": layers, "num_experts": 4,
        "num_experts_per_tok": 2, "hidden_size": 32, "num_attention_heads": 2}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos)}))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in _names(layers)}}))
    return path


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    folder = _folder(tmp_path_factory.mktemp("m") / "learner")
    srv = FakeSGLangServer(**folder_shape(folder))
    yield srv, folder
    srv.shutdown()


def test_probe_names_are_the_unfused_ones_of_the_first_and_last_layer():
    assert probe_names(_names(3)) == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                                      "model.layers.0.input_layernorm.weight", "model.layers.2.input_layernorm.weight"]
    assert folder_facts("/nonexistent") is None


def test_a_server_of_the_learners_model_passes_and_each_mismatch_is_refused_in_one_line(fake, tmp_path):
    srv, learner = fake
    check_servers([srv.url], learner)  # the fake of the same folder: passes
    cases = [
        (_folder(tmp_path / "v", vocab=1024), "vocab_size=1024 but the learner's model has 512"),
        (_folder(tmp_path / "e", eos=(7,)), "eos_token_id=[7] but the learner's model has [7, 9]"),
        (_folder(tmp_path / "l", layers=3), "num_hidden_layers=3 but the learner's model has 2"),
    ]
    for other, text in cases:
        srv.model_path = str(other)
        with pytest.raises(ConfigError, match=r"SGLang server http://127\.0\.0\.1:\d+ reports ") as e:
            check_servers([srv.url], learner)
        assert text in str(e.value) and "--model-path" in str(e.value) and "\n" not in str(e.value)
    srv.model_path = str(learner)
    srv.param_names = set(_names(1))  # a server with one layer: the learner's last-layer norm is unknown to it
    with pytest.raises(ConfigError, match=r"has no parameter model\.layers\.1\.input_layernorm\.weight "
                                          r"\(get_weights_by_name failed\), which the learner's weight sync sends"):
        check_servers([srv.url], learner)
    srv.param_names = None  # like SGLang 0.5.10.post1 for qwen3_moe: no get_weights_by_name at all -> unchecked
    check_servers([srv.url], learner)
    srv.param_names = set(_names(2))
    srv.model_type = "glm4_moe"
    with pytest.raises(ConfigError, match="reports model_type='glm4_moe' but the learner's model has 'qwen3_moe'"):
        check_servers([srv.url], learner)
    srv.model_type = "qwen3_moe"
    srv.model_path = "Qwen/Qwen3-30B-A3B"  # not a folder here: vocab and end ids cannot be compared, names still are
    check_servers([srv.url], learner)
    srv.model_path = str(learner)
    # attached via sampler.urls: the same check runs at attach
    with pytest.raises(ConfigError, match="vocab_size=512 but the learner's model has 1024"):
        start_servers(SamplerConfig(backend="sglang", urls=[srv.url]), tmp_path, str(tmp_path / "v"))


def test_started_servers_get_model_path_as_model_path_and_are_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PKG), os.environ.get("PYTHONPATH", "")]))
    learner = _folder(tmp_path / "learner", vocab=640)
    cfg = SamplerConfig(backend="sglang", num_samplers=1, start_timeout_s=120)
    procs, urls = start_servers(cfg, tmp_path, str(learner))
    try:
        assert f"--model-path {learner}" in (tmp_path / "logs" / "sglang0.log").read_text()
        check_servers(urls, learner)  # the started fake fakes that folder (vocab 640)
        with pytest.raises(ConfigError, match="vocab_size=640 but the learner's model has 512"):
            check_servers(urls, _folder(tmp_path / "other"))
    finally:
        stop_servers(procs)


def test_servers_start_from_model_path_or_the_newest_intact_checkpoint_on_resume(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2, 3):
        d = _folder(root / f"step_{step:06d}")
        (d / "trainer_state.json").write_text("{}")
        write_manifest(d)
    (root / "step_000003" / "config.json").write_text("{}")  # differs from its manifest: not intact
    cfg = SimpleNamespace(model=SimpleNamespace(path=str(tmp_path / "base")), learner=SimpleNamespace(resume=True))
    assert sglang_model_dir(cfg, tmp_path / "run") == str(root / "step_000002")
    cfg.learner.resume = False
    assert sglang_model_dir(cfg, tmp_path / "run") == str(tmp_path / "base")
    cfg.model.path = ""
    assert sglang_model_dir(cfg, tmp_path / "run") == ""  # without model.path: sampler.model_path, unchecked


def test_a_sampler_model_path_other_than_model_path_is_refused(tmp_path):
    check_sglang_model_path(str(tmp_path), str(tmp_path) + "/")
    check_sglang_model_path(str(tmp_path), "")
    check_sglang_model_path("", "/models/x")
    with pytest.raises(ConfigError, match=r"sampler\.model_path=/models/x differs from model\.path=.*drop sampler\.model_path"):
        check_sglang_model_path(str(tmp_path), "/models/x")


def test_servers_that_cannot_start_are_refused_before_anything_starts(tmp_path, monkeypatch):
    """Without sglang installed (this machine), a launch that would start servers used to print a traceback
    from the server's exit, rc 1, and leave a run dir; now one line before anything starts."""
    from t1async.service.preflight import check_sglang_servers_can_start

    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(ConfigError, match=r"^sampler\.backend=sglang starts servers with .* -m sglang\.launch_server, "
                                          r"but that Python has no sglang package: .*sampler\.urls"):
        check_sglang_servers_can_start(SamplerConfig(backend="sglang", model_path=str(tmp_path)))
    check_sglang_servers_can_start(SamplerConfig(backend="sglang", urls=["http://127.0.0.1:9"]))  # attached: not started here
    monkeypatch.setenv("PYTHONPATH", str(PKG))  # the servers' environment has one (here the fake)
    with pytest.raises(ConfigError, match=rf"^sampler\.model_path={tmp_path} has no config\.json"):
        check_sglang_servers_can_start(SamplerConfig(backend="sglang", model_path=str(tmp_path)))
    check_sglang_servers_can_start(SamplerConfig(backend="sglang", model_path=str(_folder(tmp_path / "m"))))
    check_sglang_servers_can_start(SamplerConfig(backend="sglang", model_path="Qwen/Qwen3-30B-A3B"))  # a hub id


def test_a_launch_whose_servers_cannot_start_is_one_line_and_leaves_no_run_dir(capsys, tmp_path, monkeypatch):
    from tests.support.cli import LOCAL, assert_main_one_line

    monkeypatch.delenv("PYTHONPATH", raising=False)
    run_dir = tmp_path / "run"
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={run_dir}", "sampler.backend=sglang",
                                  f"sampler.model_path={_folder(tmp_path / 'm')}"],
                         "that Python has no sglang package")
    assert not run_dir.exists()
