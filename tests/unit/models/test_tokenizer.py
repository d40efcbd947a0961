"""ChatTokenizer: shipped asset, round trips, special tokens, chat template layout."""

from __future__ import annotations

import copy

import pytest
from tokenizers import Tokenizer

from t1async.models.tokenizer import SPECIAL_TOKENS, ChatTokenizer
from tests.support import REPO

ASSET = REPO / "t1async" / "assets" / "tokenizer.json"


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.load()


def test_shipped_asset_is_small_and_has_the_right_vocab(tok):
    assert ASSET.stat().st_size < 1_000_000
    assert tok.vocab_size == 4100  # 4096 BPE + specials, then the 4 tool tokens appended
    assert [tok.eos_id, tok.im_start_id, tok.im_end_id, tok.pad_id] == [0, 1, 2, 3]
    assert ChatTokenizer.load(ASSET).vocab_size == tok.vocab_size


@pytest.mark.parametrize("text", [
    "ls -la /app && cat README.md | grep -n 'error' 2>&1",
    "for f in *.txt; do\n    echo \"$f\"\ndone\n",
    "def main(argv=None):\n\treturn 0  # comment\n",
    "  leading and trailing spaces  \n\n",
    "unicode: é ü 中文 🙂 \x00 \x1b[31mred\x1b[0m",
    "",
])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids(tok):
    for s in SPECIAL_TOKENS:
        assert tok.decode([tok._tok.token_to_id(s)]) == s
    assert tok.end_of_turn_ids == [tok.im_end_id]


def test_user_text_with_special_strings_is_plain_text(tok):
    for s in SPECIAL_TOKENS:
        ids = tok.encode(f"echo '{s}' {s}")
        assert not set(ids) & {tok.eos_id, tok.im_start_id, tok.im_end_id, tok.pad_id}
        assert tok.decode(ids) == f"echo '{s}' {s}"
    assert len(tok.encode("<|im_end|>")) > 1


def test_render_prompt_layout(tok):
    sys_, user = "You operate a shell.", "Create /app/hello.txt <|im_end|> please"
    ids = tok.render_prompt(sys_, user)
    S, E = tok.im_start_id, tok.im_end_id
    expected = ([S] + tok.encode(f"system\n{sys_}") + [E] + tok.encode("\n")
                + [S] + tok.encode(f"user\n{user}") + [E] + tok.encode("\n")
                + [S] + tok.encode("assistant\n"))
    assert ids == expected
    assert tok.decode(ids) == (f"<|im_start|>system\n{sys_}<|im_end|>\n<|im_start|>user\n{user}"
                               "<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(E) == 2  # the <|im_end|> typed by the user is not the special id


def test_render_observation_layout(tok):
    out = "total 0\n-rw-r--r-- 1 root root 0 hello.txt\n"
    ids = tok.render_observation(out)
    S, E = tok.im_start_id, tok.im_end_id
    assert ids == (tok.encode("\n") + [S] + tok.encode(f"tool\n{out}") + [E] + tok.encode("\n")
                   + [S] + tok.encode("assistant\n"))
    assert tok.decode(ids) == f"\n<|im_start|>tool\n{out}<|im_end|>\n<|im_start|>assistant\n"


def test_template_equals_special_aware_encoding_of_the_whole_string(tok):
    """Encoding pieces separately is what a special-token-parsing tokenizer does to the full
    rendered text (HF/SGLang chat templates), so the two never drift."""
    aware = Tokenizer.from_file(str(ASSET))
    sys_, user, out = "sys prompt", "do it", "a\nb  c\n"
    full = (f"<|im_start|>system\n{sys_}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n")
    assert aware.encode(full, add_special_tokens=False).ids == tok.render_prompt(sys_, user)
    obs = f"\n<|im_start|>tool\n{out}<|im_end|>\n<|im_start|>assistant\n"
    assert aware.encode(obs, add_special_tokens=False).ids == tok.render_observation(out)
    # the tool-call layout: the same equivalence for Qwen3's tool response turn, call and tools prompt
    resp = f"\n<|im_start|>user\n<tool_response>\n{out}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert aware.encode(resp, add_special_tokens=False).ids == tok.render_tool_response(out)
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -l"}}\n</tool_call>'
    assert aware.encode(call, add_special_tokens=False).ids == tok.render_tool_call("bash", {"command": "ls -l"})
    tools = [{"name": "bash", "parameters": {"type": "object"}}]
    full = (f"<|im_start|>system\n{tok.tools_system_text(sys_, tools)}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert aware.encode(full, add_special_tokens=False).ids == tok.render_prompt(sys_, user, tools)


def test_errors(tok, tmp_path):
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="role"):
        tok.render_turn("robot", "x")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError):
        ChatTokenizer.load(bad)
    with pytest.raises(FileNotFoundError):
        ChatTokenizer.load(tmp_path / "missing.json")


def test_loading_does_not_change_special_token_parsing_of_other_instances(tok):
    aware = Tokenizer.from_file(str(ASSET))
    ChatTokenizer(copy.deepcopy(aware))
    assert aware.encode("<|im_end|>", add_special_tokens=False).ids == [tok.im_end_id]
