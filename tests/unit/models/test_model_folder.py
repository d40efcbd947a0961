"""``model.path``: Hugging Face model folders in and out (t1async/models/hf_folder.py, families.py,
t1async/commands/model.py), and a rollout episode on the model's own chat template
(t1async/rollout/conversation.py).

Real tokenizer folders (the Qwen2/Qwen3 vocabulary of 151,936 ids and the Qwen3 template) come from
t1async/models/hf_tokenizers.py, built offline; the tests that need them skip with the reason where the source
archive cannot be had. transformers (a test extra) is the reference that loads what we write.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from t1async.cli import main
from t1async.config import ConfigError, EnvConfig, GenerationConfig, ModelConfig, load_config
from t1async.config.model_folder import resolve_model
from t1async.envs.protocol import CommandResult
from t1async.models import hf_tokenizers
from t1async.models.chat_template import ChatTemplateRenderer
from t1async.models.families import check_model_folder, load_model, load_renderer, save_model
from t1async.models.hf_folder import ModelFolderError, check_memory
from t1async.rollout.episode import run_episode
from t1async.sampling.sampler_client import SamplerResponse

transformers = pytest.importorskip("transformers")

SIZES = ["hidden_size=32", "num_hidden_layers=2", "num_attention_heads=2", "num_key_value_heads=1", "head_dim=16",
         "num_experts=4", "num_experts_per_tok=2", "moe_intermediate_size=32"]


@pytest.fixture(scope="module")
def qwen3_tok():
    try:
        return hf_tokenizers.build_folders(["qwen3"])["qwen3"]
    except hf_tokenizers.Unavailable as e:
        pytest.skip(f"real tokenizer folders unavailable: {e}")


@pytest.fixture(scope="module")
def tiny(qwen3_tok, tmp_path_factory):
    """A tiny random qwen3_moe folder with the real Qwen3 tokenizer and template, written by `t1async model init`."""
    out = tmp_path_factory.mktemp("m") / "tiny"
    assert main(["model", "init", "--family", "qwen3_moe", "--tokenizer", str(qwen3_tok), "--out", str(out), *SIZES]) == 0
    return out


def _cfg(folder) -> ModelConfig:
    return resolve_model(ModelConfig(path=str(folder)))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_model_init_writes_a_hf_folder_that_transformers_loads_with_equal_logits(tiny):
    names = sorted(p.name for p in tiny.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json"} <= set(names)
    cfg = _cfg(tiny)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.model_type) == (151936, 32, "qwen3_moe")
    ours = load_model(cfg).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(ids).logits.log_softmax(-1) - ref(ids).logits.float().log_softmax(-1)).abs().max()
    assert float(diff) <= 1e-5


def test_a_sharded_checkpoint_round_trips_and_transformers_loads_it(tiny, tmp_path):
    cfg = _cfg(tiny)
    model = load_model(cfg)
    names = save_model(tmp_path / "ckpt", cfg, model.state_dict(), max_shard_bytes=20_000)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert len(names) >= 3 and set(index["weight_map"].values()) == set(names)
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()
    assert (tmp_path / "ckpt" / "chat_template.jinja").read_text() == (tiny / "chat_template.jinja").read_text()
    again = load_model(cfg, tmp_path / "ckpt")
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32).eval()
    ids = torch.arange(40).reshape(2, 20) * 997
    with torch.no_grad():
        diff = (again.eval()(ids).logits.log_softmax(-1) - ref(ids).logits.float().log_softmax(-1)).abs().max()
    assert float(diff) <= 1e-5
    # and a folder transformers writes (its own layout: fused experts in v5) loads into ours
    ref.save_pretrained(str(tmp_path / "hf"))
    shutil.copy(tiny / "tokenizer.json", tmp_path / "hf")
    theirs = load_model(cfg, tmp_path / "hf").eval()
    with torch.no_grad():
        assert float((theirs(ids).logits - again(ids).logits).abs().max()) <= 1e-5


def _refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("t1async: error: ")
    return err


def _shard_edit(folder: Path, edit) -> None:
    sd = load_file(str(folder / "model.safetensors"))
    edit(sd)
    save_file(sd, str(folder / "model.safetensors"))


def _small_vocab(folder: Path, rows: int) -> None:
    _shard_edit(folder, lambda sd: sd.__setitem__("model.embed_tokens.weight", sd["model.embed_tokens.weight"][:rows]))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))


BAD = {
    "no config.json": (lambda f: (f / "config.json").unlink(), "has no config.json"),
    "unknown model_type": (lambda f: (f / "config.json").write_text(json.dumps({"model_type": "llama"})),
                           "model_type 'llama', which t1async does not run; supported: qwen3_moe"),
    "no tokenizer.json": (lambda f: (f / "tokenizer.json").unlink(), "has no tokenizer.json"),
    "template without tool turns": (
        lambda f: (f / "chat_template.jinja").write_text(
            "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
            "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
        "cannot render roles"),
    "missing weight": (lambda f: _shard_edit(f, lambda sd: sd.pop("model.norm.weight")),
                       "1 missing: model.norm.weight"),
    "extra weight": (lambda f: _shard_edit(f, lambda sd: sd.__setitem__("model.extra.weight", torch.zeros(2))),
                     "1 unexpected: model.extra.weight"),
    "mis-shaped weight": (lambda f: _shard_edit(f, lambda sd: sd.__setitem__("model.norm.weight", torch.ones(31))),
                          "mis-shaped: model.norm.weight [31] (config.json says [32])"),
    "truncated shard": (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-1000]),
                        "model.safetensors is "),
    "tokenizer larger than the embedding": (lambda f: _small_vocab(f, 1024),
                                            "the tokenizer has 151936 ids but the embedding only 1024 rows"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_model_folder_is_refused_in_one_line_naming_the_fault(case, tiny, tmp_path, capsys):
    folder = _copy(tiny, tmp_path / "m")
    edit, expected = BAD[case]
    edit(folder)
    before = sorted(p.name for p in folder.iterdir())
    err = _refusal(capsys, ["model", "check", str(folder)])
    assert expected in err, err
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written


def test_model_path_with_size_keys_or_a_missing_folder_is_refused_at_load(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"model.hidden_size conflicts with it"):
        load_config(None, [f"model.path={tiny}", "model.hidden_size=64"])
    with pytest.raises(ConfigError, match="no such folder"):
        load_config(None, [f"model.path={tmp_path / 'nope'}"])
    cfg = load_config(None, [f"model.path={tiny}"])
    assert (cfg.model.hidden_size, cfg.model.routed_layers, cfg.model.path) == (32, 2, str(tiny))


def test_a_model_that_does_not_fit_memory_is_refused_with_the_numbers(tiny):
    cfg = _cfg(tiny)
    with pytest.raises(ModelFolderError, match=r"need 0\.0 GiB .* and this machine has 0\.0 GiB available"):
        check_model_folder(cfg, available=1000)
    with pytest.raises(ModelFolderError, match=r"30,000\.0 M parameters need 111\.8 GiB in float32"):
        check_memory("big", 30_000_000_000, available=64 * 2**30)


def test_model_init_refuses_bad_input_and_writes_nothing(qwen3_tok, tmp_path, capsys):
    out = tmp_path / "x"
    assert "is not one t1async implements" in _refusal(
        capsys, ["model", "init", "--family", "llama", "--tokenizer", str(qwen3_tok), "--out", str(out)])
    assert "has no tokenizer.json" in _refusal(
        capsys, ["model", "init", "--family", "qwen3_moe", "--tokenizer", str(tmp_path), "--out", str(out)])
    assert "vocab_size=1000 is smaller than the tokenizer's 151936 ids" in _refusal(
        capsys, ["model", "init", "--family", "qwen3_moe", "--tokenizer", str(qwen3_tok), "--out", str(out), "vocab_size=1000"])
    assert "qwen3_moe has no config key 'hidden'" in _refusal(
        capsys, ["model", "init", "--family", "qwen3_moe", "--tokenizer", str(qwen3_tok), "--out", str(out), "hidden=3"])
    assert not out.exists()


class _Sampler:
    """Answers each request with the next scripted turn (routing rows: position % 4)."""

    def __init__(self, turns):
        self.turns, self.calls = list(turns), []

    def generate(self, input_ids, params, *, routed_experts_start_len=0):
        self.calls.append((list(input_ids), params))
        out = self.turns.pop(0)
        pos = np.arange(routed_experts_start_len, len(input_ids) + len(out) - 1)
        rows = np.broadcast_to((pos % 4)[:, None, None], (pos.size, 2, 2)).astype(np.int32)
        return SamplerResponse(output_ids=out, logprobs=[-0.5] * len(out), routed_experts=rows, finish_reason="stop",
                               weight_version=1)


class _Env:
    def __init__(self):
        self.commands = []

    def reset(self):
        return "Count the files in /app."

    def step(self, command):
        self.commands.append(command)
        return CommandResult(f"3 files <|im_end|> after {command}", 0, False, False, 0.0)

    def verify(self):
        return SimpleNamespace(reward=1.0, passed=1, total=1, resolved=True, tests=[], error=None)


def test_an_episode_on_the_qwen3_template_appends_sampled_ids_and_observation_turns_only(tiny):
    r = load_renderer(_cfg(tiny))
    assert isinstance(r, ChatTemplateRenderer)
    im_end = r.tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = [r.encode("<think>\nlook first\n</think>\n\nls /app") + [im_end],  # reasoning, then the command
             r.encode("wc -l"),  # cut without a stop id: repaired with <|im_end|>
             r.encode("exit") + [im_end]]
    sampler, env = _Sampler(turns), _Env()
    traj = run_episode(SimpleNamespace(name="t", agent_timeout_s=60.0), env, sampler, r, EnvConfig(max_turns=3),
                       GenerationConfig(max_new_tokens=16), _cfg(tiny), actor_id=0)
    assert env.commands == ["ls /app", "wc -l"]
    assert sampler.calls[0][1]["stop_token_ids"] == r.end_of_turn_ids
    ids = traj.token_ids.tolist()
    system, user = EnvConfig().system_prompt, "Count the files in /app."
    assert ids[:len(r.render_prompt(system, user))] == r.render_prompt(system, user)
    assert traj.drift_tokens == 0
    for (s, e), t in zip(traj.turn_offsets.tolist(), turns):
        assert ids[s:e] == t and set(traj.loss_mask[s:e].tolist()) == {1}
    # the appended observation is the template's tool turn; the printed <|im_end|> stays plain text
    s1, e1 = traj.turn_offsets[1].tolist()
    obs = ids[traj.turn_offsets[0][1]:s1]
    assert r.decode(obs).startswith("\n<|im_start|>user\n<tool_response>\n3 files <|im_end|> after ls /app")
    assert obs.count(im_end) == 1 and ids[e1] == im_end  # the template's own end only; the repair after turn 2
    # Qwen3 drops the first turn's <think> block when it re-renders the history: counted, stream kept
    assert traj.template_mismatches >= 1


def test_template_mismatches_are_counted_per_episode_not_over_the_renderer_life(tiny):
    """One renderer serves every episode of a rollout actor: each trajectory carries its own count."""
    r = load_renderer(_cfg(tiny))
    im_end = r.tokenizer.convert_tokens_to_ids("<|im_end|>")
    counts = []
    for _ in range(3):
        turns = [r.encode("<think>\nx\n</think>\n\nls") + [im_end], r.encode("exit") + [im_end]]
        traj = run_episode(SimpleNamespace(name="t", agent_timeout_s=60.0), _Env(), _Sampler(turns), r,
                           EnvConfig(max_turns=2), GenerationConfig(max_new_tokens=16), _cfg(tiny), actor_id=0)
        counts.append(traj.template_mismatches)
    assert counts[0] >= 1 and counts == [counts[0]] * 3


def test_a_tool_call_episode_on_the_qwen3_template_parses_calls_in_its_format_after_the_reasoning(tiny):
    """env.action_format=tool_call with model.path: the bash tool is declared by the template, a call is read
    in the template's format from the ids after </think>, a malformed one becomes the error observation."""
    from t1async.rollout.tool_formats import QWEN3_JSON

    r = load_renderer(_cfg(tiny))
    im_end = r.tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = r._encode_rendered(QWEN3_JSON.example("bash", {"command": "ls /app"}))
    in_thought = r._encode_rendered("<think>\n" + QWEN3_JSON.example("bash", {"command": "rm -rf /"}) + "\n</think>\n\n")
    turns = [in_thought + call + [im_end],
             r._encode_rendered('<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call>') + [im_end],
             r.encode("exit") + [im_end]]
    env = _Env()
    traj = run_episode(SimpleNamespace(name="t", agent_timeout_s=60.0), env, _Sampler(turns), r,
                       EnvConfig(max_turns=3, action_format="tool_call"), GenerationConfig(max_new_tokens=64),
                       _cfg(tiny), actor_id=0)
    assert env.commands == ["ls /app"]  # the call inside the reasoning was not run; the malformed one neither
    ids = traj.token_ids.tolist()
    assert "<tools>" in r.decode(ids[:traj.turn_offsets[0][0]]) and traj.drift_tokens == 0
    s2 = traj.turn_offsets[2][0]
    assert "[tool call error (bad_arguments)" in r.decode(ids[traj.turn_offsets[1][1]:s2])
    assert traj.finish_reason == "end_signal"


@pytest.mark.parametrize("fmt", ["command", "tool_call"])
def test_sft_demonstration_turns_are_the_templates_own_assistant_turns_and_replay_as_an_episode(tiny, fmt):
    """t1async sft with model.path: each oracle command is the assistant turn the model's template writes
    (Qwen3: an empty think block, the command or its tool call, <|im_end|>); the episode loop runs them."""
    from t1async.commands.sft import template_demonstration_turns

    r = load_renderer(_cfg(tiny))
    env_cfg = EnvConfig(max_turns=3, action_format=fmt)
    turns = template_demonstration_turns(r, env_cfg, "Count the files in /app.", ["ls /app", "wc -l x"])
    assert r.decode(turns[-1]) == "<think>\n\n</think>\n\nexit<|im_end|>"
    if fmt == "command":
        assert r.decode(turns[0]) == "<think>\n\n</think>\n\nls /app<|im_end|>"
    else:
        assert r.tokenizer.convert_tokens_to_ids("<tool_call>") in turns[0]
    env = _Env()
    traj = run_episode(SimpleNamespace(name="t", agent_timeout_s=60.0), env, _Sampler(turns), r, env_cfg,
                       GenerationConfig(max_new_tokens=64), _cfg(tiny), actor_id=0)
    assert env.commands == ["ls /app", "wc -l x"] and traj.finish_reason == "end_signal" and traj.drift_tokens == 0
