"""The one recorder behind every dialect: prompts continue the exact sampled ids; anything else is a history break.

Every dialect (t1async/rollout/endpoint/chat.py, responses.py, messages.py) turns its request into
the *neutral* conversation, OpenAI Chat Completions messages (``role`` system/user/assistant/tool,
``content`` text, an assistant's ``tool_calls`` with JSON-string ``arguments``), and its answer is
built from the neutral assistant message this module makes of the sampled ids. So one recorder
decides, for all three, what the sampler is given.

Rendering: one renderer, the run's (``render_chat`` for a segment's first request,
``render_continuation`` for the new messages after a completion): a model folder's
:class:`~t1async.models.chat_template.ChatTemplateRenderer` (its own template, tools declared its
way), or the shipped tokenizer's ChatML as Qwen3's template lays it out
(:meth:`ChatTokenizer.render_chat`), the same code the rollout loop and SFT use. The model's
tool calls, in the format its template declares (``<tool_call>`` JSON for the shipped tokenizer),
become neutral ``tool_calls``; a call that cannot be parsed stays text in ``content`` and its
turn is marked with a tool-call error code (t1async/trajectory.py).

Recording (TITO; :class:`ChatRecorder`). The prompt of a request is NOT re-rendered from the
agent's transcript when the transcript continues the previous completion: if the request's
messages are the previous request's messages, then the assistant message this endpoint returned,
then new messages, the prompt is the previous prompt + the exact sampled ids (+ the end-of-turn id
when the turn did not end with it) + the new messages rendered on their own. Any other history
(edited, truncated, re-ordered, a retry, a second conversation, a harness's compacted summary) is a
*history break*: it is counted, rendered from scratch and starts a new segment; each segment's
records extend one another exactly, so each segment is one exact trajectory
(t1async/rollout/endpoint/agent.py builds them). Nothing sampled is ever re-tokenized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from loguru import logger

from t1async.models.chat_template import ChatTemplateRenderer
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.tool_formats import ToolCallProblem, detect, tag_ids
from t1async.trajectory import TOOL_CALL_CODES


class RequestError(ValueError):
    """A request the endpoint refuses, answered in the dialect's own error shape.

    Attributes:
        status: the HTTP status.
        code: the error code (OpenAI ``error.code``; Anthropic answers its ``error.type`` for the status).
        param: the request field at fault (OpenAI ``error.param``), or None.
    """

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


# ---------------------------------------------------------------- OpenAI messages <-> ids

def _text(content: Any) -> str:
    """A message's content as text: a string, None, or a list of ``{"type": "text", "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise RequestError(f"content part {str(p)[:80]!r} is not a text part; only text content is supported")
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError(f"message content of type {type(content).__name__} is not a string or a list of text parts")


def _calls(msg: dict) -> list[tuple[str, Any]]:
    """An assistant message's tool calls as ``(name, parsed arguments)``."""
    out = []
    for c in msg.get("tool_calls") or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tool call {str(c)[:80]!r} has no function name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise RequestError(f"tool call {fn['name']!r}: arguments are not JSON: {args[:80]!r}") from None
        out.append((fn["name"], args))
    return out


def canonical(msg: Any) -> tuple:
    """A message reduced to what the template renders (role, text, tool calls): two messages that
    render alike compare equal (``None`` and ``""`` content, argument JSON spacing).

    Raises:
        RequestError: not a message with a known role.
    """
    if not isinstance(msg, dict) or msg.get("role") not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(f"message {str(msg)[:80]!r} is not an object with role system/user/assistant/tool")
    role = "system" if msg["role"] == "developer" else msg["role"]
    calls = tuple(_calls(msg)) if role == "assistant" else ()
    return role, _text(msg.get("content")), calls


def tool_specs(tools: Any) -> list[dict]:
    """The function specs of an OpenAI ``tools`` list (``[{"type": "function", "function": {...}}]``).

    Raises:
        RequestError: a tool that is not a function with a name.
    """
    specs = []
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tool {str(t)[:80]!r} is not a function with a name")
        specs.append(fn)
    return specs


def completion_message(tok: ChatTokenizer, body: Sequence[int], tool_names: set[str], call_prefix: str
                       ) -> tuple[dict, int]:
    """The OpenAI assistant message of sampled ids ``body`` (final stop id removed) and the turn's
    status code (0, or a tool-call error code of t1async/trajectory.py).

    ``<tool_call>`` spans (the special ids) holding JSON ``{"name", "arguments"}`` become
    ``tool_calls`` (ids ``{call_prefix}_{k}``); the text around them is ``content`` (None when
    empty). A span that is not such JSON, or unbalanced tags, leave the whole text in ``content``
    with code ``bad_json`` / ``unbalanced``; a call of a tool the request did not declare is
    returned and coded ``unknown_tool``.
    """
    opens = [i for i, t in enumerate(body) if t == tok.tool_call_id]
    closes = [i for i, t in enumerate(body) if t == tok.tool_call_end_id]
    text = tok.decode(body).replace("\x00", "")
    if not opens and not closes:
        return {"role": "assistant", "content": text.strip() or None}, 0
    if len(opens) != len(closes) or any(c < o for o, c in zip(opens, closes)) or any(
            o < c for o, c in zip(opens[1:], closes[:-1])):
        return {"role": "assistant", "content": text.strip() or None}, TOOL_CALL_CODES["unbalanced"]
    calls, content, prev, status = [], [], 0, 0
    for k, (o, c) in enumerate(zip(opens, closes)):
        content.append(tok.decode(body[prev:o]))
        prev = c + 1
        try:
            call = json.loads(tok.decode(body[o + 1:c]).replace("\x00", ""))
        except json.JSONDecodeError:
            call = None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)):
            return {"role": "assistant", "content": text.strip() or None}, TOOL_CALL_CODES["bad_json"]
        if tool_names and call["name"] not in tool_names:
            status = TOOL_CALL_CODES["unknown_tool"]
        calls.append({"id": f"{call_prefix}_{k}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}})
    content.append(tok.decode(body[prev:]))
    return {"role": "assistant", "content": "".join(content).replace("\x00", "").strip() or None,
            "tool_calls": calls}, status


def template_message(msg: dict) -> dict:
    """An OpenAI message as a chat template reads it: ``role`` (developer -> system), ``content`` text, an
    assistant's ``tool_calls`` with parsed ``arguments`` (templates render them as objects).

    Raises:
        RequestError: a message the template cannot render (:func:`canonical`).
    """
    role, text, calls = canonical(msg)
    out: dict = {"role": role, "content": text}
    if calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return out


def template_completion_message(renderer: ChatTemplateRenderer, body: Sequence[int], tools: Sequence[dict],
                                call_prefix: str) -> tuple[dict, int]:
    """:func:`completion_message` for a model folder's template: calls in the template's own tool-call
    format (t1async/rollout/tool_formats.py :func:`detect`), told by their tag *ids*; each span is parsed and
    checked against ``tools`` by the format. A turn with a span the format rejects (bad syntax, an unknown
    tool, arguments off the schema), or unbalanced tags, is returned as text with that reason's code."""
    text = renderer.decode(body).replace("\x00", "")
    try:
        fmt = detect(renderer.tokenizer.chat_template)
        open_id, close_id = tag_ids(renderer, fmt)
    except ValueError:  # a template without a known tool-call format: text only
        return {"role": "assistant", "content": text.strip() or None}, 0
    opens = [i for i, t in enumerate(body) if t == open_id]
    closes = [i for i, t in enumerate(body) if t == close_id]
    if not opens and not closes:
        return {"role": "assistant", "content": text.strip() or None}, 0
    if len(opens) != len(closes) or any(c < o for o, c in zip(opens, closes)) or any(
            o < c for o, c in zip(opens[1:], closes[:-1])):
        return {"role": "assistant", "content": text.strip() or None}, TOOL_CALL_CODES["unbalanced"]
    calls, content, prev = [], [], 0
    for k, (o, c) in enumerate(zip(opens, closes)):
        content.append(renderer.decode(body[prev:o]))
        prev = c + 1
        call = fmt.parse_call(renderer.decode(body[o + 1:c]).replace("\x00", ""), list(tools))
        if isinstance(call, ToolCallProblem):
            return {"role": "assistant", "content": text.strip() or None}, TOOL_CALL_CODES[call.reason]
        calls.append({"id": f"{call_prefix}_{k}", "type": "function",
                      "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}})
    content.append(renderer.decode(body[prev:]))
    return {"role": "assistant", "content": "".join(content).replace("\x00", "").strip() or None,
            "tool_calls": calls}, 0


# ---------------------------------------------------------------- recording

@dataclass
class CompletionRecord:
    """One completion as the sampler saw it (the trajectory is built from these, not from the transcript).

    Attributes:
        segment: index of the exact segment it belongs to (a new one after each history break).
        prompt_ids: every id the sampler was given.
        output_ids: the sampled ids, exactly (a matched stop id included).
        logprobs: log-prob of each sampled id.
        routed_experts: rows for positions ``routed_experts_start_len .. len(prompt) + len(output) - 2``.
        routed_experts_start_len: first position with a row here (positions before it have rows in
            earlier records of the segment).
        weight_version: version that sampled every id.
        finish_reason: ``stop``, ``length`` or ``abort``.
        status: the turn's code (0, or a tool-call error code).
        template_mismatches: 1 when the model folder's template re-renders the conversation up to this
            record's prompt other than the exact stream (its ``template_mismatches`` counter moved while
            the prompt was rendered; t1async/models/chat_template.py), else 0.
        client_disconnected: the client closed a streamed answer before its last event: the turn was
            sampled and is kept, but the client never got all of it (its tool calls were not run), so the
            trajectory marks it ``aborted`` (t1async/rollout/endpoint/agent.py :func:`segment_builder`).
    """

    segment: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    routed_experts: np.ndarray
    routed_experts_start_len: int
    weight_version: int
    finish_reason: str
    status: int = 0
    template_mismatches: int = 0
    client_disconnected: bool = False


class ChatRecorder:
    """The exact record of one episode's completions, and the prompt of the next request.

    Invariant: within a segment, every record's ``prompt_ids`` starts with the previous record's
    ``prompt_ids + output_ids`` (it *extends* it); :attr:`history_breaks` counts requests whose
    history did not continue the previous completion (each starts a new segment).
    """

    def __init__(self, tokenizer: ChatTokenizer | ChatTemplateRenderer):
        self.tok = tokenizer  # one renderer: render_chat / render_continuation / decode / end_of_turn_ids
        self.template = tokenizer if isinstance(tokenizer, ChatTemplateRenderer) else None
        self.stop_ids = tokenizer.end_of_turn_ids if self.template else [tokenizer.im_end_id, tokenizer.eos_id]
        self._hist: list[dict] = []  # template messages of the segment, assistant turns as their sampled text
        self._pending: list[dict] = []  # the request's template messages, before add()
        self._mismatch = 0  # the request's prompt() moved the template's mismatch counter (before add())
        self.records: list[CompletionRecord] = []
        self.history_breaks = 0
        self._last: tuple[list[tuple], tuple, list[dict]] | None = None  # (request messages, returned message, tools)
        self._canon: list[tuple] = []  # canonical messages of the request prompt() saw last

    def prompt(self, messages: Sequence[dict], tools: Sequence[dict]) -> tuple[list[int], int, int]:
        """(prompt ids, segment, routed-experts start) of a request: the previous completion
        extended, or, on a history break, the whole chat rendered as a new segment.

        Raises:
            RequestError: a message the template cannot render.
        """
        canon = self._canon = [canonical(m) for m in messages]  # kept for add()
        last = self.records[-1] if self.records else None
        if last is not None and self._last is not None:
            prev, returned, prev_tools = self._last
            n = len(prev)
            if canon[:n] == prev and len(canon) > n and canon[n] == returned and list(tools) == prev_tools:
                stream = [*last.prompt_ids, *last.output_ids]
                if not last.output_ids or last.output_ids[-1] not in self.tok.end_of_turn_ids:
                    stream += self.tok.end_of_turn_ids[:1]  # drift repair, as the rollout loop does
                new = [template_message(m) for m in messages[n + 1:]]
                before = getattr(self.tok, "template_mismatches", 0)  # (the shipped ChatML is append-only)
                try:
                    stream += self.tok.render_continuation(self._hist, new, tools, stream=stream)
                    self._mismatch = getattr(self.tok, "template_mismatches", 0) - before
                except ValueError as e:  # (TemplateError included)
                    raise RequestError(str(e)) from None
                self._pending = self._hist + new
                return stream, last.segment, len(last.prompt_ids) + len(last.output_ids) - 1
            self.history_breaks += 1
            logger.warning("history break {}: the request's {} messages do not continue the previous completion "
                           "(edited, truncated, re-ordered or re-sent); new exact segment", self.history_breaks,
                           len(messages))
        segment = last.segment + 1 if last is not None else 0
        self._mismatch = 0
        if not messages:
            raise RequestError("messages is empty")
        self._pending = [template_message(m) for m in messages]
        try:
            return self.tok.render_chat(self._pending, tools), segment, 0
        except ValueError as e:  # (TemplateError included)
            raise RequestError(str(e)) from None

    def add(self, record: CompletionRecord, messages: Sequence[dict], returned: dict, tools: Sequence[dict]) -> None:
        """Keep one completion and what the agent must send back to extend it (called right after
        :meth:`prompt` for the same request, whose canonical messages it reuses)."""
        record.template_mismatches = self._mismatch
        self.records.append(record)
        out = record.output_ids
        body = out[:-1] if out and out[-1] in self.stop_ids else out
        self._hist = [*self._pending, {"role": "assistant", "content": self.tok.decode(body)}]
        self._last = (self._canon if len(self._canon) == len(messages) else [canonical(m) for m in messages],
                      canonical(returned), list(tools))

    def segments(self) -> list[list[CompletionRecord]]:
        """The records grouped by segment, in order."""
        out: list[list[CompletionRecord]] = []
        for r in self.records:
            if not out or out[-1][0].segment != r.segment:
                out.append([])
            out[-1].append(r)
        return out


