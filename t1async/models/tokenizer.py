"""Byte-level BPE tokenizer with a ChatML chat template (Qwen style) for shell episodes.

The shipped asset ``t1async/assets/tokenizer.json`` is a 4096-entry byte-level BPE trained
offline by ``tools/train_tokenizer.py`` (man pages, shell scripts, Python stdlib, docs). Ids 0..3
are the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<|pad|>``; ids
4096..4099 are the tool-call special tokens ``<tool_call>``, ``</tool_call>``,
``<tool_response>``, ``</tool_response>`` (appended after training, so no earlier id moved:
:data:`BASE_VOCAB_SIZE` ids are all a ``command``-format episode can hold, and a checkpoint with
``vocab_size`` 4096 keeps working there; ``env.action_format=tool_call`` needs 4100).

Template (ChatML, as Qwen's chat models use; roles system/user/assistant/tool)::

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n

An observation is rendered *on its own* and appended after the assistant turn's ``<|im_end|>``::

    \\n<|im_start|>tool\\n{output}<|im_end|>\\n<|im_start|>assistant\\n

With ``env.action_format=tool_call`` the layout follows Qwen3's chat template for tools (its
``tokenizer_config.json`` Jinja template): the tool declarations close the system message,
an assistant turn carries ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, and a
tool result is a *user* turn wrapped in ``<tool_response>``::

    \\n<|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

Special tokens are only ever inserted by the template, as ids: :meth:`ChatTokenizer.encode`
treats its input purely as text, so a model or a command that prints ``<|im_end|>`` gets the
ordinary byte-level tokens for those characters, never the special id (no template injection).
Each text piece between special tokens is encoded separately, which is exactly what a
special-token-aware tokenizer produces for the whole rendered string.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

from t1async.config import ConfigError

__all__ = ["ChatTokenizer", "SPECIAL_TOKENS", "TOOL_TOKENS", "ROLES", "BASE_VOCAB_SIZE", "ACTION_FORMATS",
           "required_vocab_size", "check_model_vocab"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Special tokens of the tool-call format (Qwen3's names), ids 4096..4099 in the shipped asset."""
ROLES = ("system", "user", "assistant", "tool")
BASE_VOCAB_SIZE = 4096
"""Ids of the shipped tokenizer before the tool tokens: the ids a ``command`` episode can hold."""
ACTION_FORMATS = ("command", "tool_call")
"""Values of ``env.action_format`` (see t1async/rollout/actions.py)."""


def checked_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """``ids`` as a list of ints, each checked to lie in [0, vocab_size) (what a decode may be given).

    Raises:
        ValueError: an id outside [0, vocab_size) (the first five named).
    """
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside [0, {vocab_size})")
    return ids


def required_vocab_size(tokenizer: "ChatTokenizer", action_format: str) -> int:
    """Rows the model's embedding needs for episodes of ``action_format``: the ids below the
    tool tokens for ``command`` (they never enter its stream), the whole vocabulary for ``tool_call``.

    Raises:
        ValueError: unknown ``action_format``.
    """
    if action_format not in ACTION_FORMATS:
        raise ValueError(f"action_format {action_format!r} is not one of {ACTION_FORMATS}")
    if action_format == "command":
        return min(tokenizer.tool_ids) if tokenizer.tool_ids else tokenizer.vocab_size
    return tokenizer.vocab_size


def check_model_vocab(vocab_size: int, action_format: str, what: str = "model.vocab_size",
                      tokenizer: "ChatTokenizer | None" = None) -> None:
    """Refuse a model whose embedding cannot hold every id an ``action_format`` episode uses.

    Args:
        vocab_size: the model's ``vocab_size`` (rows of its embedding and LM head).
        action_format: ``command`` or ``tool_call``.
        what: how the message names the model (a config key or a checkpoint folder).
        tokenizer: default the shipped one.

    Raises:
        ConfigError: one line naming ``what``, the size needed and how to get it.
    """
    tok = tokenizer or ChatTokenizer.load()
    need = required_vocab_size(tok, action_format)
    if vocab_size < need:
        hint = (" (the tool-call tokens are ids 4096..4099; a checkpoint trained with 4096 rows cannot "
                "use them: train a new one with model.vocab_size=4100, or use env.action_format=command)"
                if action_format == "tool_call" else "")
        raise ConfigError(f"{what}={vocab_size} is smaller than the {need} tokenizer ids env.action_format={action_format} "
                          f"uses; use model.vocab_size >= {need}{hint}")


_TAG_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in TOOL_TOKENS) + ")")


class ChatTokenizer:
    """Text <-> ids for the policy, plus the chat template's token layout.

    Attributes:
        vocab_size: number of ids (special tokens included); the model's ``vocab_size`` must be
            at least this.
        im_start_id, im_end_id: ids of ``<|im_start|>`` / ``<|im_end|>``.
        eos_id: id of ``<|endoftext|>``.
        pad_id: id of ``<|pad|>`` (right padding in learner batches).
        tool_call_id, tool_call_end_id, tool_response_id, tool_response_end_id: ids of
            ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>`` (None
            when the tokenizer lacks them: then only the ``command`` format can be rendered).
        tool_ids: the four tool ids present (empty when absent).
        special_ids: every special id (the template's, the tool ones).

    Construct with :meth:`load`.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        """Wrap a ``tokenizers.Tokenizer`` that holds the four special tokens.

        Raises:
            ValueError: a special token is missing from the vocabulary.
        """
        self._tok = tokenizer
        self._tok.encode_special_tokens = True  # user text is text: never parse special tokens
        ids = {}
        for s in SPECIAL_TOKENS:
            i = tokenizer.token_to_id(s)
            if i is None:
                raise ValueError(f"tokenizer lacks the special token {s!r}")
            ids[s] = i
        self.eos_id = ids["<|endoftext|>"]
        self.im_start_id = ids["<|im_start|>"]
        self.im_end_id = ids["<|im_end|>"]
        self.pad_id = ids["<|pad|>"]
        tool = [tokenizer.token_to_id(s) for s in TOOL_TOKENS]
        self.tool_call_id, self.tool_call_end_id, self.tool_response_id, self.tool_response_end_id = tool
        self.tool_ids = frozenset(i for i in tool if i is not None)
        self.special_ids = frozenset(ids.values()) | self.tool_ids
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._newline = self.encode("\n")
        self._assistant_header = [self.im_start_id, *self.encode("assistant\n")]

    @classmethod
    def load(cls, path: str | Path | None = None) -> "ChatTokenizer":
        """Load a ``tokenizer.json``; None loads the shipped asset (via importlib.resources).

        Raises:
            FileNotFoundError: ``path`` does not exist. ValueError: not a tokenizer with the
                four special tokens.
        """
        if path is None:
            text = resources.files("t1async").joinpath("assets/tokenizer.json").read_text("utf-8")
        else:
            text = Path(path).read_text("utf-8")
        try:
            json.loads(text)
            tok = Tokenizer.from_str(text)
        except Exception as e:  # json.JSONDecodeError, tokenizers' own Exception
            raise ValueError(f"{path or 'shipped tokenizer.json'} is not a tokenizers JSON file: {e}") from None
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as plain text: special-token strings inside it are NOT special ids."""
        if not text:
            return []
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are rendered as their strings (``<|im_end|>``...).

        Ids that split a multi-byte UTF-8 character decode to U+FFFD replacement characters.

        Raises:
            ValueError: an id outside [0, vocab_size).
        """
        return self._tok.decode(checked_ids(ids, self.vocab_size), skip_special_tokens=False)

    def render_turn(self, role: str, content: str) -> list[int]:
        """``<|im_start|>{role}\\n{content}<|im_end|>`` as ids (no trailing newline).

        Raises:
            ValueError: ``role`` is not one of system/user/assistant/tool.
        """
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        return [self.im_start_id, *self.encode(f"{role}\n{content}"), self.im_end_id]

    def render_prompt(self, system: str, user: str, tools: Sequence[dict] = ()) -> list[int]:
        """Episode opening: system turn, user turn, then the assistant header.

        ``<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n``
        ``<|im_start|>assistant\\n`` as ids; the sampler continues after it. With ``tools``
        (JSON-schema function specs) the system message also declares them, as Qwen3's template
        does (:meth:`tools_system_text`); the ``<tool_call>`` tags of its format example are the
        special ids, as a tag-parsing tokenizer reads that template's output. ``user`` is always
        plain text (a task's instruction cannot inject a special id).

        Raises:
            ValueError: ``tools`` given and the tokenizer has no tool tokens.
        """
        if tools:
            self._require_tools()
            head = [self.im_start_id, *self.encode_tagged(f"system\n{self.tools_system_text(system, tools)}"),
                    self.im_end_id]
        else:
            head = self.render_turn("system", system)
        return [*head, *self._newline, *self.render_turn("user", user), *self._newline, *self._assistant_header]

    def render_observation(self, output: str) -> list[int]:
        """A tool observation rendered on its own, to append after an assistant ``<|im_end|>``:

        ``\\n<|im_start|>tool\\n{output}<|im_end|>\\n<|im_start|>assistant\\n`` as ids
        (loss mask 0 in the episode stream).
        """
        return [*self._newline, *self.render_turn("tool", output), *self._newline,
                *self._assistant_header]

    def _require_tools(self) -> None:
        if len(self.tool_ids) != len(TOOL_TOKENS):
            raise ValueError(f"this tokenizer lacks the tool-call special tokens {TOOL_TOKENS}; use the shipped "
                             "t1async/assets/tokenizer.json (or add them at the end of the vocabulary)")

    @staticmethod
    def tools_system_text(system: str, tools: Sequence[dict]) -> str:
        """The system message text that declares ``tools`` (JSON-schema function specs), laid out
        as Qwen3's template does: ``{system}\\n\\n# Tools\\n\\n...<tools>\\n{one JSON per
        tool}\\n</tools>\\n\\n...<tool_call>\\n{"name": <function-name>, "arguments":
        <args-json-object>}\\n</tool_call>``."""
        specs = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        return (f"{system}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{specs}\n"
                "</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")

    def render_tool_call(self, name: str, arguments: dict, content: str = "") -> list[int]:
        """An assistant message that calls one tool, as Qwen3's template renders it, without the
        header and ``<|im_end|>``: ``{content}\\n`` (when there is content), ``<tool_call>``,
        ``\\n{"name": name, "arguments": arguments}\\n`` (``json.dumps``, ``ensure_ascii=False``:
        the template's ``tojson``), ``</tool_call>``.

        Raises:
            ValueError: the tokenizer has no tool tokens.
        """
        self._require_tools()
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return [*self.encode(f"{content}\n" if content else ""), self.tool_call_id, *self.encode(f"\n{call}\n"),
                self.tool_call_end_id]

    def render_tool_response(self, output: str) -> list[int]:
        """A tool result rendered on its own, to append after an assistant ``<|im_end|>`` (Qwen3:
        tool results are a user turn)::

            \\n<|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

        as ids (loss mask 0). ``output`` is plain text: a ``</tool_response>`` it prints stays text.

        Raises:
            ValueError: the tokenizer has no tool tokens.
        """
        self._require_tools()
        return [*self._newline, self.im_start_id, *self.encode("user\n"), self.tool_response_id,
                *self.encode(f"\n{output}\n"), self.tool_response_end_id, self.im_end_id, *self._newline,
                *self._assistant_header]

    def render_chat(self, messages: Sequence[dict], tools: Sequence[dict] = ()) -> list[int]:
        """A whole conversation (an OpenAI client's first request) rendered as Qwen3's template does,
        then the assistant header: the message-level twin of :meth:`render_prompt`, the same interface
        as :meth:`t1async.models.chat_template.ChatTemplateRenderer.render_chat`.

        ``messages`` are template messages (``role`` system/user/assistant/tool, ``content`` text, an
        assistant's ``tool_calls`` as ``[{"function": {"name", "arguments": dict}}]``;
        t1async/rollout/endpoint/ :func:`template_message`). With ``tools`` the system turn
        declares them (:meth:`tools_system_text`; without a system message, the declaration alone).
        Each turn is followed by ``\\n``; consecutive tool messages are one user turn of
        ``<tool_response>`` blocks; an assistant turn is its stripped text, or its calls
        (:meth:`render_tool_call`, the text before the first).

        Raises:
            ValueError: a role other than system/user/assistant/tool, or ``tools`` (or a tool call or
                tool message) and the tokenizer has no tool tokens.
        """
        rest = list(messages)
        head: list[int] = []
        if tools:
            self._require_tools()
            has_system = bool(rest) and rest[0]["role"] == "system"
            text = self.tools_system_text(rest.pop(0)["content"] if has_system else "", tools)
            text = text if has_system else text.lstrip("\n")
            head = [self.im_start_id, *self.encode_tagged(f"system\n{text}"), self.im_end_id, *self._newline]
        return [*head, *self._render_turns(rest), *self._assistant_header]

    def render_continuation(self, history: Sequence[dict], new_messages: Sequence[dict],
                            tools: Sequence[dict] = (), stream: Sequence[int] | None = None) -> list[int]:
        """Ids to append after an assistant turn's ``<|im_end|>``: ``\\n``, the new messages as
        :meth:`render_chat` renders them, then the assistant header. The same interface as
        :meth:`t1async.models.chat_template.ChatTemplateRenderer.render_continuation`; this layout is
        append-only by construction (a re-render of the history is a prefix of the stream), so
        ``history`` and ``stream`` are not needed and nothing is counted as a template mismatch.

        Raises:
            ValueError: as :meth:`render_chat`.
        """
        return [*self._newline, *self._render_turns(new_messages), *self._assistant_header]

    def _render_turns(self, messages: Sequence[dict]) -> list[int]:
        """Template messages rendered turn by turn (each followed by ``\\n``), no assistant header."""
        out: list[int] = []
        i = 0
        while i < len(messages):
            m = messages[i]
            if m["role"] == "tool":
                self._require_tools()
                out += [self.im_start_id, *self.encode("user\n")]
                first = True
                while i < len(messages) and messages[i]["role"] == "tool":
                    out += ([] if first else self._newline) + [
                        self.tool_response_id, *self.encode(f"\n{messages[i]['content']}\n"), self.tool_response_end_id]
                    first, i = False, i + 1
                out += [self.im_end_id, *self._newline]
                continue
            if m["role"] == "assistant":
                content = (m.get("content") or "").strip()
                calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
                body = self.encode(content) if not calls else []
                for k, (name, args) in enumerate(calls):
                    body += (self._newline if k else []) + self.render_tool_call(name, args, content if k == 0 else "")
                out += [*self._assistant_header, *body, self.im_end_id, *self._newline]
            else:
                out += [*self.render_turn(m["role"], m.get("content") or ""), *self._newline]
            i += 1
        return out

    def encode_tagged(self, text: str) -> list[int]:
        """Ids of ``text`` with the four tool tags read as their special ids and everything else
        as plain text: what a chat template plus a tokenizer that parses those tags (Qwen3's, with
        them as added tokens) makes of a message's text. For the configured system prompt and for
        measuring how a harness would re-render a turn (``template_mismatches``); never for text
        the agent or the environment wrote (instructions, commands, outputs)."""
        if not self.tool_ids:
            return self.encode(text)
        out: list[int] = []
        for piece in _TAG_SPLIT.split(text):
            if piece in TOOL_TOKENS:
                out.append(self._tok.token_to_id(piece))
            else:
                out += self.encode(piece)
        return out

    @property
    def end_of_turn_ids(self) -> list[int]:
        """``[im_end_id]``: appended (loss mask 0) when a sampled turn did not end with it
        (drift repair), so the stream keeps the template's layout."""
        return [self.im_end_id]
