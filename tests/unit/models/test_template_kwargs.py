"""``model.chat_template_kwargs`` (issue 44): the same template variables at every render site (rollout, sft,
eval, the OpenAI-compatible endpoint, ``t1async model check``), on the real Qwen3.5 template (built offline by
t1async/models/hf_tokenizers.py; skipped, with the reason, where it cannot be had)."""

from __future__ import annotations

import json
import shutil

import pytest

from t1async.commands.evaluate import policy_model_config
from t1async.commands.model import tool_episode
from t1async.commands.sft import demonstration_turns
from t1async.config import Config, ConfigError, EnvConfig, ModelConfig, load_config
from t1async.models.families import load_renderer
from t1async.rollout.conversation import start_conversation
from t1async.rollout.endpoint.recorder import ChatRecorder

pytest.importorskip("transformers")

OFF = {"enable_thinking": False}
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3.5's generation prompt, thinking off


@pytest.fixture(scope="module")
def folder(tmp_path_factory, real_tokenizer_folders):
    """The Qwen3.5 tokenizer folder with a config.json (what resolve_model and a checkpoint folder need)."""
    src = real_tokenizer_folders(["qwen3.5"])["qwen3.5"]
    out = tmp_path_factory.mktemp("q35") / "model"
    shutil.copytree(src, out)
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe_text", "vocab_size": 151936}))
    return out


_LOADED: dict[str, object] = {}


def _renderer(folder, kwargs):
    """The run's renderer (load_renderer, as every render site gets it), loaded once per kwargs."""
    key = json.dumps(kwargs, sort_keys=True)
    if key not in _LOADED:
        _LOADED[key] = load_renderer(ModelConfig(path=str(folder), chat_template_kwargs=kwargs))
    return _LOADED[key]


def test_rollout_prompt_takes_the_kwargs(folder):
    env = EnvConfig()
    on = start_conversation(_renderer(folder, {}), env, "List the files.")
    off = start_conversation(_renderer(folder, OFF), env, "List the files.")
    assert off.r.decode(off.prompt).endswith(EMPTY_THINK)
    assert on.r.decode(on.prompt).endswith("<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("fmt", ["command", "tool_call"])
def test_sft_demonstration_turns_take_the_kwargs(folder, fmt):
    """With thinking off the demonstrated turn is the command alone (the empty block is in the prompt the
    rollout renders); with it on, the turn closes the block the generation prompt opened."""
    env = EnvConfig(action_format=fmt)
    off, on = _renderer(folder, OFF), _renderer(folder, {})
    t_off = off.decode(demonstration_turns(off, env, "List the files.", ["ls"])[0])
    t_on = on.decode(demonstration_turns(on, env, "List the files.", ["ls"])[0])
    assert "</think>" not in t_off and t_on.startswith("\n</think>\n\n")
    assert t_off.endswith("<|im_end|>") and t_on.endswith("<|im_end|>")


def test_eval_policy_takes_the_kwargs_of_its_config(folder):
    """``t1async eval --agent policy:CKPT --config C``: the checkpoint's template renders with C's kwargs."""
    cfg = Config()
    cfg.model.chat_template_kwargs = dict(OFF)
    model_cfg = policy_model_config(folder, cfg)
    assert model_cfg.chat_template_kwargs == OFF
    r = load_renderer(model_cfg)
    assert r.decode(r.render_prompt("s", "u")).endswith(EMPTY_THINK)


def test_endpoint_takes_the_kwargs(folder):
    rec = ChatRecorder(_renderer(folder, OFF))
    ids, _, _ = rec.prompt([{"role": "user", "content": "List the files."}], [])
    assert rec.tok.decode(ids).endswith(EMPTY_THINK)


def test_model_check_tool_episode_takes_the_kwargs(folder):
    off, on = tool_episode(_renderer(folder, OFF)), tool_episode(_renderer(folder, {}))
    assert off.count(EMPTY_THINK) == 3  # three assistant turns: two calls and the end signal
    assert on.count(EMPTY_THINK) == 3  # the stream closes the block the thinking prompt opened: the same text
    assert off.count("<tool_response>") == 2 and "<function=bash>" in off and off.rstrip().endswith("exit<|im_end|>")


def test_config_rules(folder):
    cfg = load_config(None, [f"model.path={folder}", "model.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.model.chat_template_kwargs == OFF
    with pytest.raises(ConfigError, match="chat_template_kwargs") as e:
        load_config(None, ["model.chat_template_kwargs={enable_thinking: false}"])
    assert "model.path" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="add_generation_prompt"):
        load_config(None, [f"model.path={folder}", "model.chat_template_kwargs={add_generation_prompt: false}"])
