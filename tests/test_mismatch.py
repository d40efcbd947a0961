"""`t1async mismatch`: real episodes (embedded sampler over HTTP, bubblewrap), re-scored four ways."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from t1async.cli import main
from t1async.commands.mismatch import MODES, measure
from t1async.config import ConfigError, load_config
from t1async.models.model import Qwen3MoeForCausalLM

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "mismatch.yaml")
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
