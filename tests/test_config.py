"""Typed config: YAML and command line override defaults; unknown keys and wrong types are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from t1async.config import Config, ConfigError, ModelConfig, load_config

REPO = Path(__file__).resolve().parents[1]


def test_shipped_configs_load():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert isinstance(load_config(path), Config)


def test_yaml_then_command_line_override_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("learner:\n  max_steps: 7\n  lr: 0.5\n")
    cfg = load_config(p, ["learner.lr=0.25"])
    assert cfg.learner.max_steps == 7 and cfg.learner.lr == 0.25
    assert cfg.learner.batch_size == Config().learner.batch_size


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("learner:\n  max_stepz: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "learner.max_stepz" in str(e.value) and "bad.yaml" in str(e.value)


def test_wrong_type_on_command_line_is_refused():
    with pytest.raises(ConfigError, match="learner.batch_size.*command line|command line.*learner.batch_size"):
        load_config(None, ["learner.batch_size=many"])


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_override_without_equals_is_refused():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["learner.max_steps"])


def test_unknown_key_lists_the_valid_keys_of_its_section():
    with pytest.raises(ConfigError, match="valid keys of learner: max_steps, batch_size"):
        load_config(None, ["learner.max_stepz=3"])


@pytest.mark.parametrize("override", ["learner.max_steps=-1", "learner.batch_timeout_s=-5", "rollout.num_actors=0",
                                      "learner.batch_size=0", "learner.publish_every=0", "generation.top_p=1.5",
                                      "transport.scheme=udp", "sampler.dtype=float99", "weight_sync.backend=mpi",
                                      "model.num_experts_per_tok=999", "model.num_key_value_heads=3",
                                      "mismatch.learner_dtype=int8", "transport.window_messages=0",
                                      "transport.window_bytes=0", "transport.spool_max_messages=0",
                                      "transport.log_fsync=sometimes", "transport.port=70000",
                                      "transport.ack_timeout_s=0", "generation.top_k=0", "generation.top_k=-2",
                                      "weight_sync.timeout_s=0", "learner.abnormal.aborted=skip",
                                      "learner.abnormal.context_full=mask_turn"])
def test_meaningless_values_are_refused(override):
    with pytest.raises(ConfigError, match=override.split("=")[0] + ".*invalid"):
        load_config(None, [override])


def test_abnormal_actions_override_and_verifier_errors_are_not_configurable():
    cfg = load_config(None, ["learner.abnormal.length_cut=mask_turn", "learner.abnormal.episode_timeout=drop"])
    assert cfg.learner.abnormal.length_cut == "mask_turn" and cfg.learner.abnormal.episode_timeout == "drop"
    assert cfg.learner.abnormal.aborted == "drop" and cfg.env.run_cut_commands is False
    with pytest.raises(ConfigError, match="learner.abnormal.verifier_error"):
        load_config(None, ["learner.abnormal.verifier_error=train"])


def test_yaml_whose_top_level_is_a_list_is_refused(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(p)


def test_greedy_generation_is_refused_for_training_but_allowed_for_eval(tmp_path):
    from t1async.envs.commands.evaluate import PolicyAgent
    from t1async.models.model import Qwen3MoeForCausalLM
    from t1async.service.launch import check_inputs

    cfg = load_config(REPO / "configs" / "local.yaml", ["generation.temperature=0"])  # loading accepts it
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)  # launch's input checks refuse it, in one line naming the key and the way out
    msg = str(e.value)
    assert "\n" not in msg and "generation.temperature=0" in msg and "eval" in msg
    # `t1async eval --agent policy:CKPT --config greedy.yaml` still samples greedily
    ckpt = tmp_path / "ckpt"
    Qwen3MoeForCausalLM(ModelConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, num_experts=2, num_experts_per_tok=1,
                                    moe_intermediate_size=16)).save_pretrained(ckpt)
    greedy = tmp_path / "greedy.yaml"
    greedy.write_text("generation:\n  temperature: 0.0\n  max_new_tokens: 4\n")
    agent = PolicyAgent(ckpt, str(greedy))
    try:
        gen = agent.cfg.generation
        r = agent.client.generate([5, 6, 7], {"max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature})
        assert len(r.output_ids) == 4 and r.logprobs == [0.0] * 4  # a point mass: log-prob 0
    finally:
        agent.close()


def test_megatron_parallel_sizes_are_checked_in_one_line():
    cfg = load_config(None, ["learner.backend=megatron", "learner.megatron.expert_parallel=2", "model.num_experts=4"])
    assert cfg.learner.megatron.expert_parallel == 2
    with pytest.raises(ConfigError) as e:
        load_config(None, ["learner.megatron.expert_parallel=3", "model.num_experts=4"])
    assert "\n" not in str(e.value) and "learner.megatron.expert_parallel=3" in str(e.value)
    assert "a divisor of model.num_experts=4, one of [1, 2, 4]" in str(e.value)
    assert load_config(None, ["learner.megatron.tensor_parallel=2"]).learner.megatron.tensor_parallel == 2
    with pytest.raises(ConfigError) as e:
        load_config(None, ["learner.megatron.tensor_parallel=3"])
    assert "\n" not in str(e.value) and "learner.megatron.tensor_parallel=3" in str(e.value)
    assert "one of [1, 2]" in str(e.value) and "'num_key_value_heads': 2" in str(e.value)
    assert load_config(None, ["learner.megatron.pipeline_parallel=2"]).learner.megatron.pipeline_parallel == 2
    with pytest.raises(ConfigError, match="learner.megatron.pipeline_parallel=3 is invalid.*one of \\[1, 2, 4\\]"):
        load_config(None, ["learner.megatron.pipeline_parallel=3"])
    with pytest.raises(ConfigError, match="pipeline_parallel=2 is invalid.*tie_word_embeddings"):
        load_config(None, ["learner.megatron.pipeline_parallel=2", "model.tie_word_embeddings=true"])


def test_sampler_urls_are_refused_unless_the_backend_is_sglang():
    """The embedded samplers start on this machine and would ignore sampler.urls (silently, before)."""
    with pytest.raises(ConfigError, match="sampler.urls.*unless sampler.backend=sglang"):
        load_config(None, ["sampler.urls=[http://10.9.9.9:30000]"])
    assert load_config(None, ["sampler.backend=sglang", "sampler.urls=[http://10.9.9.9:30000]"]).sampler.urls
