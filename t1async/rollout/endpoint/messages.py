"""Anthropic Messages (``POST /v1/messages``), streamed and not: the API Claude Code speaks.

Request: ``system`` (a string or text blocks), ``messages`` (user / assistant, and system messages
as Claude Code 2.1 sends them; content a string or
blocks: ``text``, an assistant's ``tool_use`` ``{id, name, input}``, a user's ``tool_result``
``{tool_use_id, content}``; ``thinking`` blocks are not rendered), ``tools``
(``{"name", "description", "input_schema"}``), ``max_tokens`` (required, as the API requires it),
``stream``; ``temperature`` / ``top_p`` / ``top_k`` equal to the run's or omitted. ``cache_control``
marks are ignored (the sampler's prefix cache needs none).

Neutral conversation: a user message's ``tool_result`` blocks become tool messages and its text a
user message, in their order; an assistant message's ``tool_use`` blocks its ``tool_calls``
(``input`` as JSON arguments).

Answer: a ``message`` object whose ``content`` is a ``text`` block when the turn has text and one
``tool_use`` block per call; ``stop_reason`` ``end_turn``, ``tool_use`` or ``max_tokens``.
Streamed, as Anthropic's streaming reference defines it: ``message_start``, per block
``content_block_start``, ``content_block_delta`` (``text_delta`` or ``input_json_delta``),
``content_block_stop``, then ``message_delta`` (stop reason, output tokens) and ``message_stop``; a
``ping`` while the sampler works. Errors: ``{"type": "error", "error": {"type", "message"}}`` with
Anthropic's error type for the status (in a stream: an ``error`` event).
"""

from __future__ import annotations

import json
from typing import Any

from t1async.rollout.endpoint.recorder import RequestError
from t1async.rollout.endpoint.session import (
    NeutralRequest,
    SessionLimits,
    Turn,
    check_settings,
    model_name,
    refuse_set,
    sse,
    text_pieces,
)

NAME = "messages"
REFUSED = {
    "stop_sequences": "the turn ends at the model's end-of-turn token; remove stop_sequences",
    "container": "containers are not served; the harness runs its tools in the episode's sandbox",
    "mcp_servers": "remote MCP servers are not served",
}
"""Fields refused when set, with why."""
_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 502: "api_error", 529: "overloaded_error"}


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
    for j, b in enumerate(content):
        if not isinstance(b, dict):
            raise RequestError(f"{where}.content[{j}] is not a content block", param=f"{where}.content[{j}]")
    return content


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, b in enumerate(_blocks(content, where)):
        if b.get("type") != "text":
            raise RequestError(f"{where}.content[{j}] is a {b.get('type')} block; the t1async endpoint serves text "
                               "only", param=f"{where}.content[{j}]")
        out.append(str(b.get("text", "")))
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _result_text(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise RequestError(f"{where}.role={role!r} is not user, assistant or system", param=f"{where}.role")
        if role == "system":  # (Claude Code 2.1 sends system reminders as messages of their own)
            out.append({"role": "system", "content": _result_text(m.get("content"), where)})
            continue
        text: list[str] = []
        calls: list[dict] = []
        for j, b in enumerate(_blocks(m.get("content"), where)):
            kind, at = b.get("type"), f"{where}.content[{j}]"
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str):
                    raise RequestError(f"{at} has no tool name", param=f"{at}.name")
                calls.append({"id": b.get("id") or f"toolu_{i}_{j}", "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {},
                                                                                      ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if text:  # keep the order of text and results
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _result_text(b.get("content"), at)})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # the sampled ids carry the reasoning
            else:
                raise RequestError(f"{at} is a {kind} block in a {role} message; the t1async endpoint serves text, "
                                   "tool_use and tool_result blocks", param=at)
        if role == "assistant":
            out.append({"role": "assistant", "content": "".join(text) or None, **({"tool_calls": calls} if calls
                                                                                  else {})})
        elif text:
            out.append({"role": "user", "content": "".join(text)})
    return out


def _tools(tools: Any) -> list[dict]:
    specs = []
    for k, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise RequestError(f"tools[{k}] is a {kind} tool; the t1async endpoint serves custom tools (the harness "
                               "runs them)", param=f"tools[{k}]")
        specs.append({"name": t["name"], **({"description": t["description"]} if t.get("description") else {}),
                      "parameters": t.get("input_schema") or {"type": "object", "properties": {}}})
    return specs


def parse(body: dict, limits: SessionLimits) -> NeutralRequest:
    """A Messages body as the neutral request.

    Raises:
        RequestError: a missing ``max_tokens``, a refused field (stop sequences, images, server tools, a
            forced ``tool_choice``, settings other than the run's); the error names the field.
    """
    refuse_set(body, REFUSED)
    cap = body.get("max_tokens")
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise RequestError(f"max_tokens={cap!r}: an integer >= 1 is required", param="max_tokens")
    choice = body.get("tool_choice")
    if choice is not None and (not isinstance(choice, dict) or choice.get("type") != "auto"):
        raise RequestError(f"tool_choice={choice!r}: only auto is served (forcing a call changes what the learner "
                           "scores)", param="tool_choice")
    check_settings(limits, {"temperature": (body.get("temperature"), "temperature"),
                            "top_p": (body.get("top_p"), "top_p"), "top_k": (body.get("top_k"), "top_k")})
    return NeutralRequest(_messages(body), _tools(body.get("tools")), cap, bool(body.get("stream")), model_name(body))


def _content(turn: Turn) -> list[dict]:
    blocks = []
    if turn.message.get("content"):
        blocks.append({"type": "text", "text": turn.message["content"]})
    for call in turn.message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    return blocks


def _message(req: NeutralRequest, mid: str, content: list[dict], stop: str | None, usage: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": req.model, "content": content,
            "stop_reason": stop, "stop_sequence": None, "usage": usage}


def answer(turn: Turn, req: NeutralRequest, token: str) -> dict:
    """The ``message`` object of ``turn``."""
    return _message(req, f"msg_{token[:8]}{turn.index}", _content(turn), _STOP[turn.finish],
                    {"input_tokens": turn.prompt_tokens, "output_tokens": turn.completion_tokens})


class Stream:
    """The server-sent events of one streamed message."""

    def __init__(self, req: NeutralRequest, token: str, index: int, prompt_tokens: int):
        self.req, self.mid, self.prompt_tokens = req, f"msg_{token[:8]}{index}", prompt_tokens

    def opening(self) -> list[str]:
        """``message_start`` (the prompt's tokens known) and a ``ping``, before the sampler answers."""
        start = _message(self.req, self.mid, [], None, {"input_tokens": self.prompt_tokens, "output_tokens": 0})
        return [sse({"type": "message_start", "message": start}, "message_start"), sse({"type": "ping"}, "ping")]

    def turn(self, turn: Turn) -> list[str]:
        """Each block's start, deltas and stop; ``message_delta``; ``message_stop``."""
        out = []
        for k, block in enumerate(_content(turn)):
            if block["type"] == "text":
                pieces = [{"type": "text_delta", "text": p} for p in text_pieces(block["text"])]
                start = {"type": "text", "text": ""}
            else:
                args = turn.message["tool_calls"][k - bool(turn.message.get("content"))]["function"]["arguments"]
                pieces = [{"type": "input_json_delta", "partial_json": p} for p in text_pieces(args)]
                start = {**block, "input": {}}
            out.append(sse({"type": "content_block_start", "index": k, "content_block": start}, "content_block_start"))
            out += [sse({"type": "content_block_delta", "index": k, "delta": d}, "content_block_delta") for d in pieces]
            out.append(sse({"type": "content_block_stop", "index": k}, "content_block_stop"))
        out.append(sse({"type": "message_delta", "delta": {"stop_reason": _STOP[turn.finish], "stop_sequence": None},
                        "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": turn.completion_tokens}},
                       "message_delta"))
        return out + [sse({"type": "message_stop"}, "message_stop")]

    def error(self, e: RequestError) -> list[str]:
        """An ``error`` event."""
        return [sse(error_body(e), "error")]


def error_body(e: RequestError) -> dict:
    """Anthropic's error object (its error type for the HTTP status)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": str(e)}}
