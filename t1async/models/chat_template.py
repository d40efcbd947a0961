"""A model's own chat template as the episode's token layout, append-only at the token level.

:class:`ChatTemplateRenderer` reads a Hugging Face tokenizer folder (``tokenizer.json``,
``tokenizer_config.json`` with ``chat_template`` or a ``chat_template.jinja`` beside it, and
``generation_config.json`` for the end-of-turn ids) and renders an episode the way the model was trained to
see it:

- the first prompt is the template's rendering of ``[system, user]`` with the tools declared through the
  template's own ``tools`` variable, plus the generation prompt;
- each later turn appends the *exact sampled ids* of the assistant turn and then only the ids of the new
  observation: the text the template adds when the observation message is rendered after the history
  (``add_generation_prompt=True``) minus the rendering without it, preceded by whatever the template writes
  after the assistant's end-of-turn token (Qwen's ``\\n`` after ``<|im_end|>``). The history is never
  re-tokenized, so the trajectory is the sampled stream (drift 0).

Some templates are not append-only: Qwen3's and Qwen3.5's drop or rewrite the ``<think>`` block of earlier
assistant turns, so a re-render of the whole conversation is not a prefix of the stream the model actually
sampled. :attr:`ChatTemplateRenderer.template_mismatches` counts the turns where that happens (only when the
caller passes the stream to :meth:`ChatTemplateRenderer.render_observation`); the stream is kept as sampled.

:class:`ChatRenderer` is the part of this interface the shipped ChatML renderer
(:class:`t1async.models.tokenizer.ChatTokenizer`) shares, so the rollout loop can hold either.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

from t1async.models.tokenizer import checked_ids

__all__ = ["ChatRenderer", "ChatTemplateRenderer", "TemplateError"]


_SENTINEL = "\u27e6t1async:end-of-assistant-text\u27e7"
"""Appended to the last assistant message's text to find in the rendering where that text ends."""
_NEUTRAL = "ok"
"""The assistant text rendered in place of a sampled text the template rewrites (trims, splits at
``</think>``): what follows an assistant turn does not depend on its text in the templates we know; such a
turn counts as a template mismatch."""


_HOLE = "\u27e6t1async:outside-text-{nonce}-{k}\u27e7"
"""Rendered in place of the k-th outside text that spells an added token (:meth:`ChatTemplateRenderer._mask`);
the nonce is drawn per rendering, so no text can spell a hole."""
_PAD = "\u2003"
"""Around a hole: an em space, whitespace to ``str.strip`` and Jinja's ``trim`` (a template that trims the
message text drops it) and written by no template, so the rendering tells whether the text was trimmed."""
_OUTSIDE_ROLES = ("user", "tool")
"""Roles whose message texts come from outside the policy: the task's instruction, a command's output, an external
agent's messages."""


@dataclass(frozen=True)
class _Outside:
    """The outside texts of one rendering that spell an added token, in message order.

    ``holes``: the rendering holds each as a hole named with ``nonce`` (:meth:`ChatTemplateRenderer._render_outside`);
    False where the template's output depends on such a text, so the rendering holds the texts themselves and
    they are found by search (:meth:`ChatTemplateRenderer._encode_found`)."""

    texts: tuple[str, ...] = ()
    nonce: str = ""
    holes: bool = True

    def pattern(self) -> re.Pattern:
        """A hole of this rendering, with the pads the template kept: groups (left pad, k, right pad)."""
        hole = re.escape(_HOLE.format(nonce=self.nonce, k="K")).replace("K", r"(\d+)")
        return re.compile(f"({_PAD})?{hole}({_PAD})?")

    def hole(self, k: int) -> str:
        return _PAD + _HOLE.format(nonce=self.nonce, k=k) + _PAD


class TemplateError(ValueError):
    """A tokenizer folder or its template cannot render an episode; the message names the file or the turn."""


@runtime_checkable
class ChatRenderer(Protocol):
    """What both episode renderers provide (:class:`ChatTemplateRenderer`, ``ChatTokenizer``).

    Attributes:
        vocab_size: ids the model's embedding must hold.
    """

    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as plain text."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens as their strings."""

    def render_prompt(self, system: str, user: str, tools: Sequence[dict] = ()) -> list[int]:
        """The episode's opening ids, ending with the generation prompt."""

    @property
    def end_of_turn_ids(self) -> list[int]:
        """Ids that end an assistant turn; the first closes a truncated turn (drift repair)."""


def _as_tool(spec: dict) -> dict:
    """A JSON-schema function spec (``{"name", "description", "parameters"}``, as ChatTokenizer takes) in the
    OpenAI form templates iterate over (``{"type": "function", "function": spec}``); already wrapped specs pass."""
    if not isinstance(spec, dict):
        raise TemplateError(f"a tool must be a dict (a JSON-schema function spec), got {type(spec).__name__}")
    if spec.get("type") == "function" and isinstance(spec.get("function"), dict):
        return spec
    if "name" not in spec:
        raise TemplateError(f"tool spec {spec!r} has no 'name'; give {{'name', 'description', 'parameters'}}")
    return {"type": "function", "function": spec}


def _texts(message: dict, roles: Sequence[str]) -> list[str]:
    """The outside texts of ``message`` if its role is in ``roles``: its string content, and for an assistant
    message its tool calls' string arguments."""
    if message.get("role") not in roles:
        return []
    out = [message["content"]] if isinstance(message.get("content"), str) else []
    for call in message.get("tool_calls") or () if message.get("role") == "assistant" else ():
        args = (call.get("function") or call).get("arguments") if isinstance(call, dict) else None
        out += [v for v in args.values() if isinstance(v, str)] if isinstance(args, dict) else []
    return out


def _map_texts(message: dict, roles: Sequence[str], f) -> dict:
    """A copy of ``message`` with ``f`` applied to each of its :func:`_texts`, in the same order."""
    m = dict(message)
    if m.get("role") not in roles:
        return m
    if isinstance(m.get("content"), str):
        m["content"] = f(m["content"])
    if m.get("role") == "assistant" and m.get("tool_calls"):
        calls = []
        for call in m["tool_calls"]:
            if isinstance(call, dict):
                fn = call.get("function") if isinstance(call.get("function"), dict) else None
                args = (fn or call).get("arguments")
                if isinstance(args, dict):
                    args = {k: f(v) if isinstance(v, str) else v for k, v in args.items()}
                    call = {**call, "function": {**fn, "arguments": args}} if fn is not None else {**call, "arguments": args}
            calls.append(call)
        m["tool_calls"] = calls
    return m


class ChatTemplateRenderer:
    """Episode ids from a Hugging Face tokenizer folder's own chat template.

    Attributes:
        path: the folder.
        tokenizer: the ``transformers`` fast tokenizer loaded from it.
        vocab_size: ``len(tokenizer)`` (added tokens included).
        eos_ids: end-of-turn ids, in the order of ``generation_config.json``'s ``eos_token_id`` (else the
            tokenizer's ``eos_token``).
        template_kwargs: extra template variables of every rendering (``model.chat_template_kwargs``).
        template_mismatches: turns, counted by :meth:`render_observation` when given the stream, where the
            template's re-render of the whole conversation is not a prefix of the sampled stream.

    Construct with :meth:`load`.
    """

    def __init__(self, tokenizer, eos_ids: Sequence[int], path: Path | None = None,
                 template_kwargs: dict | None = None) -> None:
        """Wrap a loaded ``transformers`` tokenizer that has a ``chat_template``; ``template_kwargs`` are extra
        variables of every rendering (``model.chat_template_kwargs``, e.g. ``{"enable_thinking": False}``).

        Raises:
            TemplateError: no chat template, or no end-of-turn id.
        """
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(f"{path or 'tokenizer'} has no chat template: put it in tokenizer_config.json's "
                                "chat_template or in chat_template.jinja")
        if not eos_ids:
            raise TemplateError(f"{path or 'tokenizer'}: no end-of-turn id (generation_config.json eos_token_id or "
                                "tokenizer eos_token)")
        self.path = path
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_ids = [int(i) for i in eos_ids]
        self._eos_text = [tokenizer.convert_ids_to_tokens(i) for i in self.eos_ids]
        self._added_text = tuple(t.content for t in tokenizer.added_tokens_decoder.values())
        self.template_kwargs = dict(template_kwargs or {})
        self.template_mismatches = 0

    @classmethod
    def load(cls, path: str | Path, template_kwargs: dict | None = None) -> "ChatTemplateRenderer":
        """Load the tokenizer folder ``path``; ``template_kwargs``: extra variables of every rendering.

        Raises:
            TemplateError: ``path`` lacks ``tokenizer.json``, a chat template or an end-of-turn id, or
                ``transformers`` is not installed.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TemplateError(f"{path} has no tokenizer.json; give a Hugging Face tokenizer or model folder")
        try:
            from transformers import AutoTokenizer  # transformers: a test extra, heavy to import
        except ImportError:
            raise TemplateError("rendering a model's own chat template needs transformers; "
                                "pip install transformers") from None
        tok = AutoTokenizer.from_pretrained(str(path))
        eos: list[int] = []
        gen = path / "generation_config.json"
        if gen.is_file():
            try:
                e = json.loads(gen.read_text("utf-8")).get("eos_token_id")
            except json.JSONDecodeError as err:
                raise TemplateError(f"{gen} is not JSON: {err}") from None
            eos = [e] if isinstance(e, int) else list(e or [])
        if not eos and tok.eos_token_id is not None:
            eos = [tok.eos_token_id]
        return cls(tok, eos, path, template_kwargs)

    # -- text <-> ids ------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as plain text: added-token strings in it (``<|im_end|>``, ``<think>``) are NOT read
        as their ids; on text without them, the same ids as the tokenizer's own encoding.

        Note the template's own output is encoded with :meth:`_encode_rendered` instead, where the template's
        special tokens are ids."""
        if not text:
            return []
        # the backend's pipeline without its added-token matcher: normalizer, pre-tokenizer, BPE model
        # (split_special_tokens would still match non-special added tokens such as Qwen3's <think>)
        b = self.tokenizer.backend_tokenizer
        if b.normalizer is not None:
            text = b.normalizer.normalize_str(text)
        pieces = b.pre_tokenizer.pre_tokenize_str(text) if b.pre_tokenizer is not None else [(text, None)]
        return [t.id for piece, _ in pieces for t in b.model.tokenize(piece)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens as their strings.

        Raises:
            ValueError: an id outside [0, vocab_size).
        """
        return self.tokenizer.decode(checked_ids(ids, self.vocab_size), skip_special_tokens=False)

    def _encode_rendered(self, text: str, outside: _Outside | None = None) -> list[int]:
        """Ids of template output: its special tokens (``<|im_start|>``, ``<tool_call>``...) as ids, as a
        template-driven tokenizer reads it (``apply_chat_template(tokenize=True)``).

        ``outside``: the outside texts of the rendering ``text`` comes from (:meth:`_render_outside`), each a
        hole in ``text``: each is encoded as plain text at its own hole, so an outside text that spells an added
        token (``<|im_start|>``, ``<tool_response>``) cannot become that token's id, and the template's own
        copy of it before the text stays the template's. The text between holes is encoded whole (identical
        to transformers' encoding of text without outside texts).
        """
        if not text:
            return []
        if outside is None or not outside.texts:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not outside.holes:
            return self._encode_found(text, outside.texts)
        ids: list[int] = []
        for piece, plain in self._pieces(text, outside):
            ids += self.encode(piece) if plain else self._encode_rendered(piece)
        return ids

    @staticmethod
    def _pieces(text: str, outside: _Outside) -> list[tuple[str, bool]]:
        """``text`` cut at its holes: (template text, False) and (outside text, True) pieces in order, each
        outside text stripped on a side where the template dropped the hole's pad (it trims message texts)."""
        out: list[tuple[str, bool]] = []
        pos = 0
        for m in outside.pattern().finditer(text):
            t = outside.texts[int(m.group(2))]
            t = t if m.group(1) else t.lstrip()
            t = t if m.group(3) else t.rstrip()
            out += [(text[pos:m.start()], False), (t, True)]
            pos = m.end()
        return out + [(text[pos:], False)]

    def _encode_found(self, text: str, plain: Sequence[str]) -> list[int]:
        """The fallback of :meth:`_encode_rendered` where a template's output depends on an outside text (so it
        could not be rendered as a hole): each text (stripped, as templates trim) is searched for in ``text``
        in order and encoded as plain text where found first.

        Raises:
            TemplateError: such a text is not found in the rendering (the template rewrote it).
        """
        ids: list[int] = []
        pos = 0
        for p in (p.strip() for p in plain):
            k = text.find(p, pos)
            if k < 0:
                raise TemplateError(f"{self.path or 'chat template'}: a message text that spells a special token "
                                    f"({p[:40]!r}...) is not in the template's rendering, so it cannot be kept plain")
            ids += self._encode_rendered(text[pos:k]) + self.encode(p)
            pos = k + len(p)
        return ids + self._encode_rendered(text[pos:])

    def _outside(self, messages: Sequence[dict], roles: Sequence[str]) -> _Outside:
        """The texts of ``messages`` of ``roles`` that spell an added token, in message order (an assistant
        message's string tool-call arguments among them when ``roles`` holds ``assistant``)."""
        return _Outside(tuple(t for m in messages for t in _texts(m, roles) if self._spells_added(t)),
                        secrets.token_hex(6))

    def _spells_added(self, text: str) -> bool:
        return any(t in text for t in self._added_text)

    def _mask(self, messages: Sequence[dict], outside: _Outside, roles: Sequence[str]) -> list[dict]:
        """``messages`` with each of ``outside``'s texts replaced by its hole (:meth:`_outside`'s order)."""
        if not outside.holes or not outside.texts:
            return [dict(m) for m in messages]
        k = 0

        def hole(t: str) -> str:
            nonlocal k
            if not self._spells_added(t):
                return t
            k += 1
            return outside.hole(k - 1)

        return [_map_texts(m, roles, hole) for m in messages]

    def _render_outside(self, messages: Sequence[dict], tools: Sequence[dict], generation_prompt: bool,
                        roles: Sequence[str] = _OUTSIDE_ROLES) -> tuple[str, _Outside]:
        """The template's text for ``messages`` with each outside text that spells an added token as a hole,
        and those texts (for :meth:`_encode_rendered`). Checked: the holes filled give the template's own
        rendering of ``messages``; where they do not (the template reads the text: Qwen3.5 takes a user text
        wrapped in ``<tool_response>`` for a tool result), the rendering of ``messages`` itself, its outside
        texts found by search.

        Raises:
            TemplateError: the template cannot render them.
        """
        outside = self._outside(messages, roles)
        if not outside.texts:
            return self._render(messages, tools, generation_prompt), outside
        text = self._render(self._mask(messages, outside, roles), tools, generation_prompt)
        real = self._render(messages, tools, generation_prompt)
        if "".join(p for p, _ in self._pieces(text, outside)) == real:
            return text, outside
        return real, replace(outside, holes=False)

    def _render(self, messages: list[dict], tools: Sequence[dict], generation_prompt: bool) -> str:
        """The template's text for ``messages``, with :attr:`template_kwargs` (every rendering goes through here).

        Raises:
            TemplateError: the template raised (the message names the template's own complaint).
        """
        try:
            return self.tokenizer.apply_chat_template(messages, tools=[_as_tool(t) for t in tools] or None,
                                                      add_generation_prompt=generation_prompt, tokenize=False,
                                                      **self.template_kwargs)
        except TemplateError:
            raise
        except Exception as e:  # jinja2's TemplateError and the template's raise_exception
            raise TemplateError(f"{self.path or 'chat template'} cannot render roles "
                                f"{[m.get('role') for m in messages]}: {e}") from None

    # -- episode layout ----------------------------------------------------------------------------------------

    def render_prompt(self, system: str, user: str, tools: Sequence[dict] = ()) -> list[int]:
        """Episode opening: the template's rendering of a system and a user message, the tools declared
        through its ``tools`` variable, then the generation prompt; ids equal to transformers'
        ``apply_chat_template(messages, tools=..., add_generation_prompt=True)``.

        Args:
            system, user: message texts (an empty ``system`` omits the system message).
            tools: JSON-schema function specs (``{"name", "description", "parameters"}``) or their OpenAI
                ``{"type": "function", "function": ...}`` form.

        Raises:
            TemplateError: the template cannot render them.
        """
        return self._encode_rendered(*self._render_outside(self._opening(system, user), tools, True))

    def render_chat(self, messages: Sequence[dict], tools: Sequence[dict] = ()) -> list[int]:
        """A whole conversation (an OpenAI client's first request) as the template renders it, tools declared
        through its ``tools`` variable, then the generation prompt; ids equal to transformers'
        ``apply_chat_template(messages, tools=..., add_generation_prompt=True)`` (user and tool texts that
        spell a special token stay plain text, :meth:`_encode_rendered`).

        Raises:
            TemplateError: the template cannot render them.
        """
        return self._encode_rendered(*self._render_outside([dict(m) for m in messages], tools, True))

    @staticmethod
    def _opening(system: str, user: str) -> list[dict]:
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]

    def render_observation(self, history: Sequence[dict], observation_message: dict | str,
                           tools: Sequence[dict] = (), stream: Sequence[int] | None = None) -> list[int]:
        """:meth:`render_continuation` of one observation message (a string: a tool message with that content)."""
        obs = {"role": "tool", "content": observation_message} if isinstance(observation_message, str) \
            else dict(observation_message)
        return self.render_continuation(history, [obs], tools, stream)

    def render_continuation(self, history: Sequence[dict], new_messages: Sequence[dict],
                            tools: Sequence[dict] = (), stream: Sequence[int] | None = None) -> list[int]:
        """Ids to append after an assistant turn's exact sampled ids: the new messages (an observation, or the
        tool results and user turns an OpenAI client sends) as the template renders them, then the next
        generation prompt.

        Found at the text level, never by re-tokenizing the history: the template renders ``history +
        [observation]`` with the generation prompt, once as is and once with a marker appended to the last
        assistant message's text (the two must differ only by the marker). The new text is what follows the
        first end-of-turn token (:attr:`end_of_turn_ids`) after the marker: whatever the template writes after
        the assistant's ``<|im_end|>`` (Qwen's ``\\n``), the observation turn, the next generation prompt. An
        end-of-turn token that the template writes as the start of the next turn (GLM's ``<|observation|>``)
        is therefore not repeated: the sampled stream already ends with it. The rendering of the conversation
        *without* the observation is not used, because templates render the last assistant turn differently
        (Qwen3 adds an empty ``<think>`` block to it). A sampled turn that did not end with an end-of-turn id
        must be closed with ``end_of_turn_ids[:1]`` first.

        Args:
            history: the conversation so far as messages (``role``, ``content``), ending with the assistant
                turn whose text is the decoded sampled ids.
            new_messages: the new messages (``{"role": "tool", "content": ...}``, user messages), at least one.
            tools: the tools the prompt declared (the template may render them in every turn).
            stream: the episode's ids so far (prompt, sampled and appended ids); when given, the turn is
                counted in :attr:`template_mismatches` if the template's re-render of the whole conversation
                is not a prefix-equal of ``stream`` plus the returned ids.

        Returns:
            the new ids (loss mask 0 in the episode).

        Raises:
            TemplateError: the history does not end with an assistant message, the template cannot render
                the observation, the template rewrites the assistant's text so its end cannot be found, or no
                end-of-turn token follows it.
        """
        history = [dict(m) for m in history]
        if not history or history[-1].get("role") != "assistant":
            raise TemplateError(f"render_observation needs a history that ends with the assistant turn, got roles "
                                f"{[m.get('role') for m in history]}")
        obs = [dict(m) for m in new_messages]
        if not obs:
            raise TemplateError("render_continuation needs at least one new message")
        content = history[-1].get("content") or ""
        if not isinstance(content, str) or _SENTINEL in content:
            raise TemplateError("the last assistant message's content must be the sampled text (a string)")
        after, outside = self._render_outside(history + obs, tools, True)
        rest = self._after_marker(history, content, obs, tools, after, outside)
        rewritten = rest is None
        if rewritten:  # the template rewrote the sampled text (trimmed it, split it at </think>): a neutral text
            rest = self._after_marker(history, _NEUTRAL, obs, tools, None, outside)
        if rest is None:
            raise TemplateError(f"{self.path or 'chat template'}: cannot find where the assistant turn ends in the "
                                "template's rendering (it rewrites the turn's text); this template cannot be appended to")
        found = [(rest.find(s), s) for s in self._eos_text if s in rest]
        if not found:
            raise TemplateError(f"{self.path or 'chat template'}: none of the end-of-turn tokens {self._eos_text} "
                                "(generation_config.json eos_token_id) follows the assistant turn in the rendering")
        pos, s = min(found)
        new = rest[pos + len(s):]
        # found by search (the fallback), only the new messages' texts are in the new text
        ids = self._encode_rendered(new, outside if outside.holes else self._outside(obs, _OUTSIDE_ROLES))
        if stream is not None and rewritten:
            self.template_mismatches += 1
        elif stream is not None:
            if self._encode_rendered(after, outside) != [*stream, *ids]:
                self.template_mismatches += 1
        return ids

    def render_assistant(self, history: Sequence[dict], message: dict, tools: Sequence[dict] = ()) -> list[int]:
        """The ids a model trained on this template samples for assistant ``message`` after ``history``: the
        text the template writes for the message after the generation prompt, up to and including the first
        end-of-turn token (a demonstration's turn, ``t1async sft``). A template that writes no token at the end
        of an assistant turn (GLM-4.6: the next turn's ``<|observation|>`` ends it) is rendered with the tool
        message the rollout loop appends next, and the turn ends at that message's end-of-turn token.

        The message's texts (its content, its tool calls' string arguments) are outside text: one that spells
        an added token stays plain text (:meth:`_encode_rendered`).

        Raises:
            TemplateError: the rendering with the message does not extend the generation prompt, or holds no
                end-of-turn token after it.
        """
        history = [dict(m) for m in history]
        roles = (*_OUTSIDE_ROLES, "assistant")  # a demonstration's command is outside text too
        head = None
        for after in ([], [{"role": "tool", "content": "ok"}]):
            full, outside = self._render_outside([*history, dict(message), *after], tools, False, roles)
            head = self._render(self._mask(history, outside, roles), tools, True)
            if not full.startswith(head):
                raise TemplateError(f"{self.path or 'chat template'}: an assistant message does not extend the "
                                    "generation prompt in this template's rendering")
            turn = full[len(head):]
            found = [(turn.find(t), t) for t in self._eos_text if t in turn]  # an outside text's copy is a hole
            if found:
                pos, eos = min(found)
                return self._encode_rendered(turn[:pos + len(eos)],
                                             outside if outside.holes else self._outside([message], roles))
        raise TemplateError(f"{self.path or 'chat template'}: no end-of-turn token {self._eos_text} after the "
                            "assistant message")

    def _after_marker(self, history: list[dict], content: str, obs: list[dict], tools: Sequence[dict],
                      after: str | None, outside: _Outside) -> str | None:
        """The rendering that follows the last assistant message's text when that text is ``content``: the
        template renders it with a marker appended (the outside texts as ``outside``'s holes); None when the
        marker is lost, or when ``after`` (the rendering of the sampled text) does not end with the same text
        (the template rewrote the turn)."""
        marked = self._render(self._mask(history[:-1] + [{**history[-1], "content": content + _SENTINEL}, *obs],
                                         outside, _OUTSIDE_ROLES), tools, True)
        k = marked.find(_SENTINEL)
        if k < 0:
            return None
        rest = marked[k + len(_SENTINEL):]
        if after is not None and (marked[:k] + rest != after and not after.endswith(rest)):
            return None
        return rest

    @property
    def end_of_turn_ids(self) -> list[int]:
        """:attr:`eos_ids` (a copy): ids that end a sampled assistant turn (sampler stop ids); the first is
        appended (loss mask 0) to close a turn that did not end with one (drift repair)."""
        return list(self.eos_ids)
