"""`t1async mismatch`: real episodes (embedded sampler over HTTP, bubblewrap), re-scored four ways."""

from __future__ import annotations

import json

import numpy as np
import pytest

from t1async.cli import main
from t1async.commands.mismatch import MODES, measure
from t1async.config import ConfigError, load_config
from t1async.models.model import Qwen3MoeForCausalLM
from tests.support import REPO

CONFIG = str(REPO / "configs" / "mismatch.yaml")
TINY = ["model.num_hidden_layers=4", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_key_value_heads=1",
        "model.num_experts=16", "model.num_experts_per_tok=4", "model.moe_intermediate_size=32",
        "mismatch.episodes=2", "env.max_turns=2", "generation.max_new_tokens=16", "run.torch_threads=1",
        "env.tasks=[create-hello-file,count-error-lines]"]
KEYS = {"logprob_diff_mean", "kl_k3", "routing_diff_frac", "drift_tokens"}


def test_bf16_sampler_fp32_learner_table_from_the_cli(capsys):
    assert main(["mismatch", CONFIG, *TINY]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == set(MODES)
    for mode, row in out.items():
        assert KEYS <= set(row), mode
        assert row["kl_k3"] >= 0 and row["loss_tokens"] > 0
    both, tito, none = out["both"], out["tito"], out["none"]
    assert both["routing_diff_frac"] == 0 and both["drift_tokens"] == 0 and tito["drift_tokens"] == 0
    assert out["r3"]["drift_tokens"] == none["drift_tokens"] > 0  # naive re-encoding of sampled text drifts
    assert tito["router_diff_frac"] > 0 and tito["routing_diff_frac"] == tito["router_diff_frac"]  # bf16 flips
    assert both["router_diff_frac"] > 0  # the routers would flip; replay overrides them
    assert both["logprob_diff_mean"] < none["logprob_diff_mean"]


def test_equal_precision_both_is_at_the_float_floor():
    cfg = load_config(CONFIG, [*TINY, "sampler.dtype=float32", "mismatch.learner_dtype=float32"])
    out = measure(cfg)
    assert out["both"]["logprob_diff_mean"] < 1e-5
    assert out["both"]["routing_diff_frac"] == 0 and out["both"]["drift_tokens"] == 0
    assert out["tito"]["logprob_diff_mean"] < 1e-3  # fp32 vs fp32: a near-tie flip at most


def test_pretraining_specialises_and_checkpoints(tmp_path):
    ck = tmp_path / "spec"
    cfg = load_config(CONFIG, [*TINY, "mismatch.pretrain_steps=25", "mismatch.pretrain_seq_len=64",
                               "mismatch.pretrain_batch=4", f"mismatch.save_checkpoint={ck}", "mismatch.episodes=1",
                               "env.max_turns=1"])
    from t1async.commands.mismatch import build_policy

    policy, stats = build_policy(cfg)
    assert stats["loss_last"] < stats["loss_first"] and stats["corpus_tokens"] > 10_000
    loaded = Qwen3MoeForCausalLM.from_pretrained(ck)
    assert all(np.array_equal(p.detach().numpy(), loaded.get_parameter(n).detach().numpy())
               for n, p in policy.named_parameters())
    cfg2 = load_config(CONFIG, [*TINY, f"mismatch.init_checkpoint={ck}", "mismatch.episodes=1", "env.max_turns=1"])
    out = measure(cfg2)
    assert out["both"]["routing_diff_frac"] == 0 and out["both"]["drift_tokens"] == 0
    with pytest.raises(ValueError, match="learner_dtype"):
        measure(load_config(CONFIG, [*TINY, "mismatch.learner_dtype=int8"]))


def test_tempered_nucleus_sampling_is_scored_under_the_same_processing():
    cfg = load_config(CONFIG, [*TINY, "sampler.dtype=float32", "mismatch.learner_dtype=float32", "mismatch.episodes=1",
                               "generation.temperature=0.5", "generation.top_p=0.9", "generation.top_k=50"])
    out = measure(cfg)
    assert out["both"]["logprob_diff_mean"] < 1e-5 and out["both"]["kl_k3"] < 1e-8
    assert out["both"]["nucleus_boundary_tokens"] == 0 and out["both"]["loss_tokens"] > 0
    with pytest.raises(ConfigError, match="generation.temperature=0"):
        measure(load_config(CONFIG, [*TINY, "generation.temperature=0"]))


@pytest.mark.slow
def test_model_path_qwen3_5_moe_folder_tito_and_replay_agree(tmp_path):
    """model.path on a tiny random qwen3_5_moe folder (real Qwen3.5 tokenizer and template): the embedded
    sampler and the learner, both built by families.load_model at float32, agree on every sampled token."""
    from t1async.models import hf_tokenizers

    try:
        tok = hf_tokenizers.build_folders(["qwen3.5"])["qwen3.5"]
    except hf_tokenizers.Unavailable as e:
        pytest.skip(f"real tokenizer folders unavailable: {e}")
    folder = tmp_path / "qwen35"
    assert main(["model", "init", "--family", "qwen3_5_moe", "--tokenizer", str(tok), "--out", str(folder)]) == 0
    cfg_file = tmp_path / "mismatch.yaml"
    cfg_file.write_text("run: {seed: 0, torch_threads: 1}\nsampler: {dtype: float32}\n"
                        "generation: {max_new_tokens: 16, temperature: 1.0}\nenv: {max_turns: 2, command_timeout_s: 5.0}\n"
                        "mismatch: {episodes: 2, learner_dtype: float32}\n")
    out = measure(load_config(str(cfg_file), [f"model.path={folder}", "env.tasks=[create-hello-file,count-error-lines]"]))
    for mode in ("tito", "both"):
        assert out[mode]["loss_tokens"] > 0 and out[mode]["drift_tokens"] == 0, mode
        assert out[mode]["logprob_diff_mean"] < 1e-5, mode
    assert out["both"]["routing_diff_frac"] == 0 and out["tito"]["routing_diff_frac"] == 0
    assert out["none"]["drift_tokens"] > 0  # the folder's tokenizer re-encodes sampled text differently
