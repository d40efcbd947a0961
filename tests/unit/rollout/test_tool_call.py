"""env.action_format=tool_call: parsing, error observations, and the exact ids of a tool-call episode.

The sampler and the shell are faked (scripted turns, echoing shell); the rollout loop, the
tokenizer and the template are the real ones.
"""

from __future__ import annotations

import json

import pytest

from t1async.config import ConfigError, EnvConfig, GenerationConfig, load_config
from t1async.learner.abnormal import tool_call_counts, turn_counts
from t1async.models.tokenizer import BASE_VOCAB_SIZE, TOOL_TOKENS, ChatTokenizer, check_model_vocab
from t1async.rollout.actions import BASH_TOOL, action_turn_ids, parse_action, prompt_ids
from t1async.rollout.episode import run_episode
from t1async.trajectory import TOOL_CALL_ERRORS, decode, encode
from tests.support.episode_fakes import MODEL, FakeEnv, ScriptedSampler

TOK = ChatTokenizer.load()
TC, TCE, TR, TRE = TOK.tool_call_id, TOK.tool_call_end_id, TOK.tool_response_id, TOK.tool_response_end_id
ENV = EnvConfig(action_format="tool_call", max_turns=8)


def call_ids(payload: str) -> list[int]:
    return [TC, *TOK.encode(f"\n{payload}\n"), TCE]


def bash(command: str) -> str:
    return json.dumps({"name": "bash", "arguments": {"command": command}})


def test_tool_tokens_are_appended_and_never_parsed_from_text():
    assert [TOK._tok.token_to_id(t) for t in TOOL_TOKENS] == [4096, 4097, 4098, 4099]
    assert TOK.vocab_size == BASE_VOCAB_SIZE + 4 and [TOK.eos_id, TOK.im_start_id, TOK.im_end_id, TOK.pad_id] == [0, 1, 2, 3]
    ids = TOK.encode("echo '<tool_call>' </tool_response>")
    assert not set(ids) & TOK.tool_ids and TOK.decode(ids) == "echo '<tool_call>' </tool_response>"
    assert TOK.decode([TC, TCE, TR, TRE]) == "".join(TOOL_TOKENS)


def test_vocab_check_per_action_format():
    check_model_vocab(4096, "command")  # old checkpoints keep working in the command format
    with pytest.raises(ConfigError, match="4100"):
        check_model_vocab(4096, "tool_call")
    check_model_vocab(4100, "tool_call")
    with pytest.raises(ConfigError, match="env.action_format"):
        load_config(None, ["env.action_format=json"])


@pytest.mark.parametrize("body,reason", [
    (TOK.encode("ls -la"), "no_tool_call"),
    ([*call_ids(bash("ls")), *call_ids(bash("pwd"))], "multiple_calls"),
    ([TC, *TOK.encode(bash("ls"))], "unbalanced"),
    ([*TOK.encode(bash("ls")), TCE], "unbalanced"),
    (call_ids('{"name": "bash", "arguments": {"command": "ls"'), "bad_json"),
    (call_ids('["bash"]'), "bad_json"),
    (call_ids('{"name": "python", "arguments": {"code": "1"}}'), "unknown_tool"),
    (call_ids('{"name": "bash"}'), "bad_arguments"),
    (call_ids('{"name": "bash", "arguments": {"command": 3}}'), "bad_arguments"),
    (call_ids('{"name": "bash", "arguments": {"cmd": "ls"}}'), "bad_arguments"),
    (call_ids('{"name": "bash", "arguments": {"command": "ls", "timeout": 3}}'), "bad_arguments"),
    (TOK.encode(f"<tool_call>\n{bash('ls')}\n</tool_call>"), "no_tool_call"),  # tags typed as text are not calls
])
def test_malformed_calls_are_errors_with_a_message(body, reason):
    action = parse_action(TOK, body, "tool_call", "exit")
    assert action.error == reason and not action.end and action.command == ""
    assert action.message.startswith(f"[tool call error ({reason})") and '"name": "bash"' in action.message


def test_valid_calls_and_the_end_signal():
    a = parse_action(TOK, [*TOK.encode("Let me look."), *call_ids(bash(" ls -la "))], "tool_call", "exit")
    assert (a.command, a.end, a.error) == ("ls -la", False, None)
    assert parse_action(TOK, TOK.encode(" exit\n"), "tool_call", "exit").end
    assert parse_action(TOK, call_ids(bash("exit")), "tool_call", "exit").end
    assert parse_action(TOK, TOK.encode("ls"), "command", "exit").command == "ls"


def test_two_turn_tool_call_episode_has_exact_ids_and_recovers_from_errors():
    t1 = [*call_ids(bash("ls")), TOK.im_end_id]  # valid, ended with <|im_end|>
    t2 = call_ids('{"name": "bash", "arguments": {"command": }}')  # bad JSON, no stop id: repaired
    t3 = [*TOK.encode("exit"), TOK.im_end_id]
    sampler, env = ScriptedSampler([t1, t2, t3]), FakeEnv()
    task = type("T", (), {"name": "t", "agent_timeout_s": 60.0})()
    traj = run_episode(task, env, sampler, TOK, ENV, GenerationConfig(max_new_tokens=64), MODEL, actor_id=0)
    assert env.commands == ["ls"] and traj.finish_reason == "end_signal"
    prompt = prompt_ids(TOK, ENV, "make a file")
    error = parse_action(TOK, t2, "tool_call", "exit").message
    expected = [*prompt, *t1, *TOK.render_tool_response("ran ls"), *t2, TOK.im_end_id,
                *TOK.render_tool_response(error), *t3]
    assert traj.token_ids.tolist() == expected
    # the exact layout, spelled out: Qwen3's tool response turn; the system turn names the tags twice (as ids)
    obs = TOK.render_tool_response("ran ls")
    assert obs == [*TOK.encode("\n"), TOK.im_start_id, *TOK.encode("user\n"), TR, *TOK.encode("\nran ls\n"), TRE,
                   TOK.im_end_id, *TOK.encode("\n"), TOK.im_start_id, *TOK.encode("assistant\n")]
    assert prompt.count(TC) == 2 and prompt.count(TCE) == 2 and json.dumps(BASH_TOOL["parameters"]) in TOK.decode(prompt)
    spans = traj.turn_offsets.tolist()
    for (s, e), sampled, call in zip(spans, [t1, t2, t3], sampler.calls):
        assert traj.token_ids[s:e].tolist() == sampled and traj.loss_mask[s:e].all() and call == expected[:s]
    assert int(traj.loss_mask.sum()) == len(t1) + len(t2) + len(t3)
    assert traj.drift_tokens == 0
    assert [TOOL_CALL_ERRORS.get(int(c), "ok") for c in traj.turn_status] == ["ok", "bad_json", "ok"]
    back = decode(encode(traj))  # the codes travel on the wire
    assert tool_call_counts([back])["bad_json"] == 1 and sum(tool_call_counts([back]).values()) == 1
    assert sum(turn_counts([back]).values()) == 0
    # t1 renders as the template would; t2 (malformed) re-renders with its tags parsed, as sampled + repair
    assert traj.template_mismatches == 0


def test_demonstration_turns_use_the_tool_format():
    assert action_turn_ids(TOK, "ls", "tool_call") == [*call_ids(bash("ls")), TOK.im_end_id]
    assert action_turn_ids(TOK, "ls", "command") == [*TOK.encode("ls"), TOK.im_end_id]
    assert parse_action(TOK, action_turn_ids(TOK, "cat 'a b' | wc -l", "tool_call")[:-1], "tool_call",
                        "exit").command == "cat 'a b' | wc -l"


def test_sft_demonstration_in_the_tool_call_format_is_the_rollout_stream(tmp_path):
    from t1async.commands.sft import demonstration
    from t1async.envs.taskio.loading import load_task
    from t1async.envs.terminal import TerminalEnv
    from tests.support.tasks import note_task

    task = load_task(note_task(tmp_path / "tasks", "note"))
    cfg = load_config(None, ["env.action_format=tool_call", "model.vocab_size=4100"])
    with TerminalEnv.from_config(task, tmp_path / "work", cfg.env) as env:
        traj = demonstration(task, env, cfg, TOK)
    assert traj.resolved and traj.drift_tokens == 0 and traj.template_mismatches == 0
    turns = [traj.token_ids[s:e].tolist() for s, e in traj.turn_offsets]
    assert turns == [action_turn_ids(TOK, "cat note.txt", "tool_call"), action_turn_ids(TOK, "echo done > out.txt", "tool_call"),
                     [*TOK.encode("exit"), TOK.im_end_id]]
    (_, e1), (s2, _) = traj.turn_offsets[:2]
    assert traj.token_ids[e1:s2].tolist() == TOK.render_tool_response("pebble-42\n")
    assert traj.token_ids[: traj.turn_offsets[0][0]].tolist() == prompt_ids(TOK, cfg.env, task.instruction)
    assert not traj.turn_status.any()
