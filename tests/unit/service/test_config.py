"""Typed config: YAML and command line override defaults; unknown keys and wrong types are refused."""

from __future__ import annotations

import dataclasses

import pytest

from t1async.config import Config, ConfigError, ModelConfig, check_values, load_config, to_yaml
from tests.support import REPO


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
    from t1async.commands.evaluate import PolicyAgent
    from t1async.models.model import Qwen3MoeForCausalLM
    from t1async.service.preflight import check_inputs

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


def test_each_section_refuses_a_bad_value_of_its_own_fields_itself():
    """The rule of a field sits beside it (t1async/config/rules.py): the section's own ``check``
    refuses the value, in the one line load_config gives (without the source)."""
    from t1async.config import AbnormalConfig, FieldError, LearnerConfig, Section, TransportConfig, sections
    from t1async.config.rules import field_rule

    with pytest.raises(FieldError, match=r"^learner.batch_size=0 is invalid: use an integer >= 1$"):
        LearnerConfig(batch_size=0).check("learner")
    from t1async.config import SamplerConfig

    # refused at load, not by the sampler actor after Ray and the run directory have started
    with pytest.raises(FieldError, match=r"^sampler.max_batch=0 is invalid: use an integer >= 1$"):
        SamplerConfig(max_batch=0).check("sampler")
    with pytest.raises(FieldError, match=r"^sampler.prefix_cache=-1 is invalid: use an integer >= 0$"):
        SamplerConfig(prefix_cache=-1).check("sampler")
    with pytest.raises(FieldError, match=r"^transport.port=70000 is invalid: use a TCP port in \[0, 65535\]"):
        TransportConfig(port=70000).check("transport")
    with pytest.raises(FieldError, match=r"^learner.abnormal.context_full='mask_turn' is invalid: use 'train' or 'drop'"):
        AbnormalConfig(context_full="mask_turn").check("learner.abnormal")
    with pytest.raises(FieldError, match=r"^model.num_key_value_heads=3 is invalid: it must be a divisor of model.num_"):
        ModelConfig(num_key_value_heads=3).check("model")  # a rule over two fields of one section is the section's
    LearnerConfig(batch_size=0, lr=0.0)  # building one in code checks nothing (tests build such sections)
    keys = dict(sections(Config()))
    assert list(keys)[:3] == ["run", "ray", "model"] and {"learner.abnormal", "learner.megatron", "env.container"} <= set(keys)
    for key, section in keys.items():
        assert isinstance(section, Section), key
        section.check(key)  # the defaults pass their own rules
    ruled = {f"{key}.{f.name}" for key, s in keys.items() for f in dataclasses.fields(s) if field_rule(f)}
    assert len(ruled) >= 90 and {"learner.max_steps", "sampler.backend", "learner.megatron.device"} <= ruled
    assert check_values(load_config(None, ["learner.lr=0.5"])) is None
    with pytest.raises(ConfigError, match=r"^scale: learner.megatron.timeout_s=0 is invalid: use a positive number"):
        cfg = Config()
        cfg.learner.megatron.timeout_s = 0
        check_values(cfg, source="scale")  # (t1async scale sets values on a copy and checks them so)


def choice_fields() -> list[tuple[str, type]]:
    """Every config key typed with a Choice, and its Enum."""
    from t1async.config import Choice, sections

    return [(f"{key}.{f.name}", type(f.default)) for key, s in sections(Config())
            for f in dataclasses.fields(s) if isinstance(f.default, Choice)]


def test_choices_are_enums_whose_values_can_be_listed_and_compare_as_strings():
    from t1async.config import ADVANTAGE_NAMES, AdvantageName, Reward, SandboxName
    from t1async.envs.sandboxes.sandbox import SANDBOXES

    assert list(Reward) == [Reward.dense, Reward.binary] and Reward.values() == ("dense", "binary")
    assert AdvantageName.values() == ADVANTAGE_NAMES and set(SandboxName.values()) == set(SANDBOXES)
    keys = dict(choice_fields())
    assert {"learner.reward", "learner.advantage", "learner.policy_loss", "learner.backend", "env.sandbox",
            "env.network", "env.action_format", "transport.scheme", "sampler.backend", "sampler.dtype",
            "weight_sync.mode", "rollout.admission", "learner.abnormal.aborted"} <= set(keys)
    cfg = load_config(None, ["learner.reward=binary", "env.action_format=tool_call"])
    assert cfg.learner.reward is Reward.binary and cfg.learner.reward == "binary" and cfg.learner.reward != "dense"
    assert f"{cfg.env.action_format}" == str(cfg.env.action_format) == "tool_call"
    assert repr(cfg.learner.reward) == "'binary'" and {"binary": 1}[cfg.learner.reward] == 1
    assert "reward: binary" in to_yaml(cfg)


@pytest.mark.parametrize("key,kind", choice_fields(), ids=[k for k, _ in choice_fields()])
def test_a_value_outside_a_choice_is_refused_in_one_line_naming_key_value_and_the_choices(key, kind):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}=nonsense"])
    msg = str(e.value)
    assert msg.startswith(f"command line: {key}='nonsense' is invalid: use ") and "\n" not in msg, msg
    assert all(v in msg for v in kind.values() if not (key.startswith("learner.abnormal.") and v == "mask_turn")), msg


@pytest.mark.parametrize("word,expected", [("on", "on"), ("off", "off")])
def test_on_and_off_on_the_command_line_are_the_choices_not_yaml_booleans(word, expected):
    """YAML 1.1 reads a bare on/off as a boolean; a Choice field takes the word (env.network=on, as the docs
    write it for the harnesses); a non-Choice field still reads YAML as before."""
    cfg = load_config(None, [f"env.network={word}", "env.keep_agent_processes=yes"])
    assert cfg.env.network == expected and cfg.env.keep_agent_processes is True


def test_a_context_bound_past_the_models_context_is_refused_in_one_line():
    """Issue 42 (a fresh user): ``env.max_context_tokens`` above ``model.max_position_embeddings``
    was silently capped, so an operator who set it to see long trajectories refused at intake saw
    episodes end ``context_full`` first; it is refused, naming both numbers."""
    from t1async.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["env.max_context_tokens=20000", "model.max_position_embeddings=8192"])
    assert "env.max_context_tokens=20000 is invalid: it must be at most model.max_position_embeddings=8192" in str(e.value)
    assert "\n" not in str(e.value)
    assert load_config(None, ["env.max_context_tokens=8192", "model.max_position_embeddings=8192"]).env.max_context_tokens == 8192
