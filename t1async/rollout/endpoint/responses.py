"""OpenAI Responses (``POST /v1/responses``), streamed and not: the API Codex CLI speaks.

Request: ``instructions`` (a system message), ``input`` (a string, or items: messages of role
user / system / developer / assistant with ``input_text`` / ``output_text`` parts, ``function_call``
items, ``function_call_output`` items; ``reasoning`` items are not rendered), ``tools`` (flat
``{"type": "function", "name", "description", "parameters"}``; hosted tools are left out of the prompt
and counted, :func:`_tools`), ``max_output_tokens``, ``stream``;
``temperature`` / ``top_p`` equal to the run's or omitted. The endpoint keeps no responses:
``previous_response_id`` is refused (send the whole input, ``store: false`` as Codex does).

Neutral conversation: an assistant message and the ``function_call`` items right after it are one
assistant message with ``tool_calls`` (the calls' ``call_id`` as ids); each ``function_call_output``
is a tool message.

Answer: a ``response`` object whose ``output`` is a ``message`` item (``output_text``) when the turn
has text and one ``function_call`` item per call; ``status`` ``incomplete``
(``max_output_tokens``) for a turn cut at the token cap. Streamed: ``response.created``,
``response.in_progress``, then per item ``response.output_item.added``, (``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``) or
(``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``),
``response.output_item.done``, and ``response.completed`` (or ``response.incomplete``), each with a
``sequence_number``, as OpenAI's API reference names them. Errors: OpenAI's ``{"error": {...}}``; in a
stream, ``response.failed``.
"""

from __future__ import annotations

import time
from typing import Any

from t1async.rollout.endpoint.recorder import RequestError
from t1async.rollout.endpoint.session import (
    NeutralRequest,
    SessionLimits,
    Turn,
    check_settings,
    max_tokens_field,
    model_name,
    refuse_set,
    sse,
    text_pieces,
)

NAME = "responses"
REFUSED = {
    "previous_response_id": "the endpoint keeps no responses; send the whole input (store=false)",
    "conversation": "the endpoint keeps no conversations; send the whole input",
    "background": "background responses are not served",
    "prompt": "stored prompt templates are not served; send instructions and input",
    "top_logprobs": "log-probs are recorded for the learner, not returned",
}
"""Fields refused when set, with why."""
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if kind not in _TEXT_PARTS or not isinstance(p.get("text"), str):
            raise RequestError(f"{where}.content[{j}] is a {kind} part; the t1async endpoint serves text only",
                               param=f"{where}.content[{j}]")
        out.append(p["text"])
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        out.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestError("input must be a string or a list of items", param="input")
    calls_of: dict | None = None  # the assistant message the next function_call items join
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} is not an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role={role!r} is not user, system, developer or assistant",
                                   param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), where)})
            calls_of = out[-1] if role == "assistant" else None
        elif kind == "function_call":
            if calls_of is None:
                calls_of = {"role": "assistant", "content": None}
                out.append(calls_of)
            if not isinstance(item.get("name"), str):
                raise RequestError(f"{where} has no function name", param=f"{where}.name")
            calls_of.setdefault("tool_calls", []).append(
                {"id": item.get("call_id") or f"call_{i}", "type": "function",
                 "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, where)})
            calls_of = None
        elif kind == "reasoning":
            continue  # the sampled ids carry the reasoning; a summary item is not rendered again
        else:
            raise RequestError(f"{where} is a {kind} item; the t1async endpoint serves messages, function_call and "
                               "function_call_output items", param=f"{where}.type")
    if not out:
        raise RequestError("input is empty", param="input")
    return out


def _tools(tools: Any) -> tuple[list[dict], list[str]]:
    """(function specs, the hosted tools left out). A hosted tool (``web_search``, ``file_search``, a
    ``namespace`` of sub-agent tools, ...) is the server's to run, and this server runs none: it is not
    declared to the model (so it cannot be called) and is named in the second list, which the session
    counts and logs (Codex CLI declares ``web_search`` and a ``namespace`` with every request)."""
    specs, left_out = [], []
    for k, t in enumerate(tools or []):
        if not isinstance(t, dict):
            raise RequestError(f"tools[{k}] is not a tool object", param=f"tools[{k}]")
        if t.get("type") != "function":
            left_out.append(str(t.get("name") or t.get("type")))
            continue
        if not isinstance(t.get("name"), str):
            raise RequestError(f"tools[{k}].name is missing: a function tool needs a name", param=f"tools[{k}].name")
        specs.append({"name": t["name"], **({"description": t["description"]} if t.get("description") else {}),
                      "parameters": t.get("parameters") or {"type": "object", "properties": {}}})
    return specs, left_out


def parse(body: dict, limits: SessionLimits) -> NeutralRequest:
    """A Responses body as the neutral request.

    Raises:
        RequestError: a refused field (stored state, images, built-in tools, a forced ``tool_choice``,
            a structured ``text.format``, settings other than the run's); the error names the field.
    """
    refuse_set(body, REFUSED)
    choice = body.get("tool_choice")
    if choice not in (None, "auto"):
        raise RequestError(f"tool_choice={choice!r}: only auto is served (forcing a call changes what the learner "
                           "scores)", param="tool_choice")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise RequestError(f"text.format={fmt.get('type')!r}: constrained output changes what the learner scores; "
                           "use text", param="text.format")
    check_settings(limits, {"temperature": (body.get("temperature"), "temperature"),
                            "top_p": (body.get("top_p"), "top_p")})
    tools, left_out = _tools(body.get("tools"))
    return NeutralRequest(_messages(body), tools, max_tokens_field(body, "max_output_tokens"),
                          bool(body.get("stream")), model_name(body),
                          {"instructions": body.get("instructions"), "tools": body.get("tools") or [],
                           "hosted_tools_left_out": left_out})


def _items(turn: Turn, rid: str) -> list[dict]:
    items = []
    text = turn.message.get("content")
    if text:
        items.append({"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": []}]})
    for call in turn.message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def _response(req: NeutralRequest, rid: str, created: int, status: str, output: list[dict], turn: Turn | None) -> dict:
    usage = None if turn is None else {
        "input_tokens": turn.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": turn.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": turn.prompt_tokens + turn.completion_tokens}
    return {"id": f"resp_{rid}", "object": "response", "created_at": created, "status": status, "model": req.model,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.options.get("instructions"), "tools": req.options.get("tools", []),
            "tool_choice": "auto", "parallel_tool_calls": True, "metadata": {}, "text": {"format": {"type": "text"}},
            "store": False}


def answer(turn: Turn, req: NeutralRequest, token: str) -> dict:
    """The ``response`` object of ``turn``."""
    rid = f"{token[:8]}{turn.index}"
    return _response(req, rid, int(time.time()), "incomplete" if turn.finish == "length" else "completed",
                     _items(turn, rid), turn)


class Stream:
    """The server-sent events of one streamed response."""

    def __init__(self, req: NeutralRequest, token: str, index: int, prompt_tokens: int):
        self.req, self.rid, self.created, self.seq = req, f"{token[:8]}{index}", int(time.time()), 0

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, kind)

    def opening(self) -> list[str]:
        """``response.created`` and ``response.in_progress`` (sent before the sampler answers)."""
        r = _response(self.req, self.rid, self.created, "in_progress", [], None)
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def turn(self, turn: Turn) -> list[str]:
        """Each output item's events, then ``response.completed`` (``response.incomplete`` when cut)."""
        out = []
        items = _items(turn, self.rid)
        for k, item in enumerate(items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                out.append(self._event("response.output_item.added", output_index=k,
                                       item={**item, "status": "in_progress", "content": []}))
                part = {"type": "output_text", "text": "", "annotations": []}
                out.append(self._event("response.content_part.added", item_id=item["id"], output_index=k,
                                       content_index=0, part=part))
                out += [self._event("response.output_text.delta", item_id=item["id"], output_index=k,
                                    content_index=0, delta=piece, logprobs=[]) for piece in text_pieces(text)]
                out.append(self._event("response.output_text.done", item_id=item["id"], output_index=k,
                                       content_index=0, text=text, logprobs=[]))
                out.append(self._event("response.content_part.done", item_id=item["id"], output_index=k,
                                       content_index=0, part={**part, "text": text}))
            else:
                out.append(self._event("response.output_item.added", output_index=k,
                                       item={**item, "arguments": "", "status": "in_progress"}))
                out += [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                                    delta=piece) for piece in text_pieces(item["arguments"])]
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                                       name=item["name"], arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=k, item=item))
        status = "incomplete" if turn.finish == "length" else "completed"
        out.append(self._event(f"response.{status}",
                               response=_response(self.req, self.rid, self.created, status, items, turn)))
        return out

    def error(self, e: RequestError) -> list[str]:
        """``response.failed`` with the error."""
        r = _response(self.req, self.rid, self.created, "failed", [], None)
        r["error"] = {"code": e.code, "message": str(e)}
        return [self._event("response.failed", response=r)]


def error_body(e: RequestError) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": str(e), "type": "invalid_request_error" if e.status < 500 else "server_error",
                      "param": e.param, "code": e.code}}

