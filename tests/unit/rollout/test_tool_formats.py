"""Tool calls in the model's own format (t1async/rollout/tool_formats.py), checked against what the real chat
templates of Qwen3, Qwen3-Coder, Qwen3.5 and GLM-4.6 render (tokenizer folders built offline by
t1async/models/hf_tokenizers.py; skipped, with the reason, where the source archive cannot be had)."""

from __future__ import annotations

import pytest

from t1async.models.chat_template import ChatTemplateRenderer
from t1async.rollout.tool_formats import (
    BASH_TOOL,
    FORMATS,
    GLM45,
    QWEN3_CODER_XML,
    QWEN3_JSON,
    ToolCall,
    ToolCallFormat,
    ToolCallProblem,
    check_call,
    detect,
    error_message,
    parse_ids,
    tag_ids,
)
from tests.support.templates import renderer  # each folder loaded once per module

EXPECTED = {"qwen3": "qwen3_json", "qwen3-coder": "qwen3_coder_xml", "qwen3.5": "qwen3_coder_xml",
            "glm-4.6": "glm45"}
# a command with what a layout could trip on: newlines, quotes, a backslash, angle brackets, non-ASCII
COMMAND = "cat <<'EOF' > a.txt\nsay \"hi\" \\ <b> & ü\nEOF\nwc -l a.txt"
TYPED = {"name": "run", "description": "Run a command with options.",
         "parameters": {"type": "object", "required": ["cmd"],
                        "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"},
                                       "verbose": {"type": "boolean"}, "env": {"type": "object"},
                                       "paths": {"type": "array"}, "ratio": {"type": "number"}}}}
TYPED_ARGS = {"cmd": "make -j4\nmake test", "timeout": 30, "verbose": True, "env": {"A": "1", "B": [2]},
              "paths": ["a b", "c"], "ratio": 0.5}


@pytest.fixture(scope="module")
def folders(real_tokenizer_folders):
    """Every tokenizer folder this module checks."""
    return real_tokenizer_folders(EXPECTED)


def _assistant_turn(r: ChatTemplateRenderer, content: str, name: str, arguments: dict, tools: list[dict]) -> str:
    """The text of an assistant turn that calls ``name`` with ``arguments``, as the template renders it after
    the generation prompt (up to its end-of-turn token): what a model trained on it samples."""
    history = [{"role": "system", "content": "You are a shell agent."}, {"role": "user", "content": "Count lines."}]
    call = {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}
    head = r._render(history, tools, True)
    full = r._render(history + [call], tools, False)
    assert full.startswith(head)
    turn = full[len(head):]
    cut = [turn.index(s) for s in r._eos_text if s in turn]
    return turn[:min(cut)] if cut else turn


@pytest.mark.parametrize("name", list(EXPECTED))
def test_detect_gives_the_format_the_template_declares(folders, name):
    assert detect(renderer(folders, name).tokenizer.chat_template).name == EXPECTED[name]


def test_detect_refuses_a_template_without_a_known_format():
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="no known tool-call format") as e:
        detect(chatml)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in FORMATS)
    with pytest.raises(ValueError, match="several formats"):
        detect("<function=x><parameter=y> <arg_key><arg_value>")


@pytest.mark.parametrize("name", list(EXPECTED))
@pytest.mark.parametrize("command", [COMMAND, "\nls\n\n", ""], ids=["heredoc", "newlines", "empty"])
def test_a_rendered_bash_call_parses_back_from_text_and_ids(folders, name, command):
    r = renderer(folders, name)
    fmt = detect(r.tokenizer.chat_template)
    assert isinstance(fmt, ToolCallFormat)
    turn = _assistant_turn(r, "I will write the file." if command else "", "bash", {"command": command}, [BASH_TOOL])
    assert fmt.example("bash", {"command": command}) in turn  # the hint shows the model its own layout
    expected = ToolCall("bash", {"command": command})
    assert fmt.parse(turn) == expected
    ids = r._encode_rendered(turn)  # the ids the model samples: the tags are single added-token ids
    assert ids.count(r.tokenizer.convert_tokens_to_ids("<tool_call>")) == 1
    assert parse_ids(r, ids) == expected == parse_ids(r, ids, fmt)
    # another format's parser does not read it as a valid call
    assert all(isinstance(f.parse(turn), ToolCallProblem) for f in FORMATS.values() if f is not fmt)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_typed_arguments_convert_as_the_schema_says(folders, name):
    r = renderer(folders, name)
    turn = _assistant_turn(r, "", "run", TYPED_ARGS, [TYPED])
    assert parse_ids(r, r._encode_rendered(turn), tools=[TYPED]) == ToolCall("run", TYPED_ARGS)


@pytest.mark.parametrize("fmt", [QWEN3_CODER_XML, GLM45], ids=lambda f: f.name)
def test_a_value_that_does_not_convert_is_bad_arguments(fmt):
    for key, raw in [("timeout", "soon"), ("timeout", "1.5"), ("verbose", "yes"), ("env", "[1]"), ("ratio", "x")]:
        text = fmt.example("run", {"cmd": "ls", key: raw})
        got = fmt.parse(text, [TYPED])
        assert got.reason == "bad_arguments" and f"the argument {key} is {raw!r}" in got.what, (key, raw, got)


def _malformed(fmt: ToolCallFormat) -> list[tuple[str, str]]:
    """(assistant text, expected reason) for each reason, written in ``fmt``."""
    ok = fmt.example("bash", {"command": "ls"})
    broken = {QWEN3_JSON: '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}\n</tool_call>',
              QWEN3_CODER_XML: "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</function>\n</tool_call>",
              GLM45: "<tool_call>bash\n<arg_key>command</arg_key>\n</tool_call>"}[fmt]
    return [("Let me think about it.", "no_tool_call"),
            (ok.replace(fmt.close_tag, ""), "unbalanced"),
            (ok.replace(fmt.open_tag, ""), "unbalanced"),
            (f"{fmt.close_tag}{fmt.open_tag}", "unbalanced"),
            (f"{ok}\n{ok}", "multiple_calls"),
            (broken, "bad_json"),
            (fmt.example("python", {"command": "ls"}), "unknown_tool"),
            (fmt.example("bash", {}), "bad_arguments"),
            (fmt.example("bash", {"command": "ls", "cwd": "/tmp"}), "bad_arguments"),
            (fmt.example("bash", {"cmd": "ls"}), "bad_arguments")]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_malformed_calls_give_their_reason_from_text_and_ids(folders, name):
    r = renderer(folders, name)
    fmt = detect(r.tokenizer.chat_template)
    for text, reason in _malformed(fmt):
        for got in (fmt.parse(text), parse_ids(r, r._encode_rendered(text))):
            assert isinstance(got, ToolCallProblem) and got.reason == reason, (text, got)
    message = error_message(fmt.parse("no call"), fmt, "exit")
    assert message.startswith("[tool call error (no_tool_call): ") and fmt.example("bash", {"command": "ls"}) in message


def test_schema_check_wording():
    assert check_call("bash", {"command": 3}) == ToolCallProblem("bad_arguments",
                                                                 "the argument command is a int, not a string.")
    assert check_call("sh", {}).what == "there is no tool 'sh'; the only tool is 'bash'."
    assert check_call("bash", {"command": "ls", "x": 1}).what == "unexpected arguments ['x']; bash takes only command."
    assert check_call("run", {"cmd": "ls", "timeout": True}, [TYPED]).what == \
        "the argument timeout is a bool, not an integer."
    assert check_call("bash", "ls").reason == "bad_arguments"
    # the one invalid call of the qwen3_json layout: a string command written as a number
    assert QWEN3_JSON.parse(QWEN3_JSON.example("bash", {"command": 3})).reason == "bad_arguments"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_tag_spelled_as_plain_text_is_not_a_call(folders, name):
    r = renderer(folders, name)
    fmt = detect(r.tokenizer.chat_template)
    open_id, close_id = tag_ids(r, fmt)
    call = fmt.example("bash", {"command": "rm -rf /app"})
    plain = r.encode(call)  # the same characters as ordinary tokens: no tag id
    assert open_id not in plain and close_id not in plain and r.decode(plain) == call
    assert fmt.parse(r.decode(plain)).name == "bash"  # as text it would be a call: the ids decide
    assert parse_ids(r, plain).reason == "no_tool_call"
    # a spelled tag next to a real call is text, not a second call; inside the call it is the command's text
    real = r._encode_rendered(fmt.example("bash", {"command": "ls"}))
    assert parse_ids(r, [*plain, *real]) == ToolCall("bash", {"command": "ls"})
    inner = "echo '<tool_call>'"
    before, after = fmt.example("bash", {"command": "@"}).split("@")
    ids = [*r._encode_rendered(before), *r.encode(inner), *r._encode_rendered(after)]
    assert ids.count(open_id) == 1 and parse_ids(r, ids) == ToolCall("bash", {"command": inner})


def test_tags_must_be_single_ids():
    class Plain:  # a tokenizer where <tool_call> is no added token
        class tokenizer:
            added_tokens_decoder: dict = {}
            chat_template = "<tool_call>\n{\"name\": ..."
    with pytest.raises(ValueError, match="no single added-token id"):
        parse_ids(Plain(), [1, 2, 3])


TWO = {"name": "run", "description": "Run a command, with a note.",
       "parameters": {"type": "object", "required": ["cmd"],
                      "properties": {"cmd": {"type": "string"}, "note": {"type": "string"}}}}


@pytest.mark.parametrize("name", ["qwen3-coder", "qwen3.5", "glm-4.6"])
def test_a_value_holding_its_own_closing_tag_parses_back(folders, name):
    """Issue 41 item 13: a value that contains the format's closing tag (Qwen3.5's ``</parameter>``, GLM's
    ``</arg_value>``), as the real template renders it, ends at the closing tag followed by the next
    parameter or the end of the call; before the fix such calls were malformed."""
    r = renderer(folders, name)
    fmt = detect(r.tokenizer.chat_template)
    close = {"qwen3_coder_xml": "</parameter>", "glm45": "</arg_value>"}[fmt.name]
    opener = {"qwen3_coder_xml": "<parameter=cmd>", "glm45": "<arg_value>"}[fmt.name]
    for arguments in ({"cmd": f"grep -c '{close}' calls.xml"},
                      {"cmd": f"echo '{close}'\n{close}", "note": f"{close} then {opener}x{close}"},
                      {"cmd": close, "note": "done"}):
        turn = _assistant_turn(r, "", "run", arguments, [TWO])
        assert fmt.parse(turn, [TWO]) == ToolCall("run", arguments), (arguments, fmt.parse(turn, [TWO]))
        assert parse_ids(r, r._encode_rendered(turn), tools=[TWO]) == ToolCall("run", arguments)
