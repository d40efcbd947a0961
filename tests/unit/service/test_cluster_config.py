"""configs/cluster.yaml, the mission's own command, passes the launch's pre-flight on a model folder, so it
cannot silently rot again: the same call ``t1async launch`` makes first (config loading, every section's
rules, the cross rules, then every input check), with only the overrides its header tells a user to give
(the machine's addresses and folders) and a tiny Qwen3-MoE folder written by ``t1async model init`` with a
real tokenizer. Only what cannot exist here is stood in: the ``sglang`` package the servers would start
with (tests/fake_sglang_pkg on PYTHONPATH, as tests/contracts/test_sglang_launch.py does)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from t1async.cli import main
from t1async.config import ConfigError
from t1async.models import hf_tokenizers
from t1async.service.preflight import preflight
from t1async.transport.keys import write_keys
from tests.support import REPO, TESTS

CLUSTER = REPO / "configs" / "cluster.yaml"
PKG = TESTS / "fake_sglang_pkg"
SIZES = ["hidden_size=32", "num_hidden_layers=2", "num_attention_heads=2", "num_key_value_heads=1", "head_dim=16",
         "num_experts=4", "num_experts_per_tok=2", "moe_intermediate_size=32"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    try:
        tok = hf_tokenizers.build_folders(["qwen3"])["qwen3"]
    except hf_tokenizers.Unavailable as e:
        pytest.skip(f"real tokenizer folders unavailable: {e}")
    out = tmp_path_factory.mktemp("cluster") / "policy"
    assert main(["model", "init", "--family", "qwen3_moe", "--tokenizer", str(tok), "--out", str(out), *SIZES]) == 0
    return out


def _machine(tmp_path: Path, folder: Path) -> list[str]:
    """The overrides cluster.yaml's header asks for, pointed at this machine."""
    write_keys(tmp_path / "keys")
    return [f"model.path={folder}", "transport.host=127.0.0.1", "weight_sync.master_address=127.0.0.1",
            f"transport.keys_dir={tmp_path / 'keys'}", f"transport.spool_dir={tmp_path / 'spool'}",
            f"run.dir={tmp_path / 'run'}"]


@pytest.mark.slow
def test_cluster_yaml_passes_the_launch_preflight_on_a_model_folder(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PKG), os.environ.get("PYTHONPATH", "")]))
    cfg, run_dir, tasks = preflight(str(CLUSTER), _machine(tmp_path, folder))
    assert cfg.model.path == str(folder) and cfg.model.model_type == "qwen3_moe"
    assert (cfg.learner.backend, cfg.sampler.backend, cfg.weight_sync.backend) == ("megatron", "sglang", "nccl")
    assert cfg.model.hidden_size == 32 and tasks and not run_dir.exists()
    raw = yaml.safe_load(CLUSTER.read_text())
    assert "model" not in raw and "model_path" not in raw["sampler"]  # the folder is the architecture


def test_cluster_yaml_without_a_model_folder_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PKG), os.environ.get("PYTHONPATH", "")]))
    write_keys(tmp_path / "keys")
    with pytest.raises(ConfigError) as e:
        preflight(str(CLUSTER), ["transport.host=127.0.0.1", "weight_sync.master_address=127.0.0.1",
                                 f"transport.keys_dir={tmp_path / 'keys'}", f"run.dir={tmp_path / 'run'}"])
    assert "model.path" in str(e.value) and "\n" not in str(e.value)


def test_cluster_yaml_refuses_size_keys_beside_the_folder(folder, tmp_path, monkeypatch):
    """The rot the file had: model.* size keys beside model.path are refused in one line."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PKG), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(ConfigError) as e:
        preflight(str(CLUSTER), [*_machine(tmp_path, folder), "model.hidden_size=2048"])
    assert "hidden_size" in str(e.value) and "\n" not in str(e.value)
