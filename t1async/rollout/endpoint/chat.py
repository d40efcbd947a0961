"""OpenAI Chat Completions (``POST /v1/chat/completions``), streamed and not.

Request: ``messages`` (system / developer / user / assistant with ``tool_calls`` / tool with
``tool_call_id``; content a string or text parts), ``tools`` (``{"type": "function", "function":
{...}}``), ``max_completion_tokens`` / ``max_tokens``, ``stream`` (+ ``stream_options.include_usage``),
``temperature`` / ``top_p`` equal to the run's ``generation.*`` or omitted. Messages are the
recorder's neutral shape already (t1async/rollout/endpoint/recorder.py).

Answer: a ``chat.completion`` object; streamed, ``chat.completion.chunk`` objects as server-sent
``data:`` lines (the role first, then content deltas, each tool call's ``id``/``name`` then its
``arguments`` deltas, a chunk with ``finish_reason``, the usage chunk when asked) and ``data: [DONE]``,
as OpenAI's API reference defines the stream. Errors: ``{"error": {"message", "type", "param", "code"}}``
(in a stream: one ``data:`` line holding it).
"""

from __future__ import annotations

import time
from typing import Any

from t1async.rollout.endpoint.recorder import RequestError, tool_specs
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

NAME = "chat"
REFUSED = {
    "stop": "the turn ends at the model's end-of-turn token; remove stop",
    "response_format": "constrained output changes what the learner scores; remove response_format",
    "logit_bias": "it changes what the learner scores; remove logit_bias",
    "presence_penalty": "it changes what the learner scores; remove presence_penalty",
    "frequency_penalty": "it changes what the learner scores; remove frequency_penalty",
    "functions": "the legacy functions field is not served; declare tools",
    "audio": "only text is served; remove audio",
    "prediction": "predicted outputs are not served; remove prediction",
}
"""Fields refused when set (anything but null/false/empty), with why."""


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of message objects", param="messages")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                if kind != "text":
                    raise RequestError(f"messages[{i}].content[{j}] is a {kind} part; the t1async endpoint serves "
                                       "text only", param=f"messages[{i}].content[{j}]")
    return messages


def parse(body: dict, limits: SessionLimits) -> NeutralRequest:
    """A Chat Completions body as the neutral request.

    Raises:
        RequestError: a refused field (``n`` > 1, stop strings, images, settings other than the run's,
            a forced ``tool_choice``), a bad message or tool; the error names the field.
    """
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError(f"n={n}: one choice per request is served; send n=1 or omit it", param="n")
    refuse_set(body, REFUSED)
    if body.get("tool_choice") not in (None, "auto"):
        raise RequestError(f"tool_choice={body['tool_choice']!r}: only auto is served (forcing a call changes what "
                           "the learner scores)", param="tool_choice")
    check_settings(limits, {"temperature": (body.get("temperature"), "temperature"),
                            "top_p": (body.get("top_p"), "top_p")})
    opts = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    return NeutralRequest(_check_messages(body.get("messages")), tool_specs(body.get("tools")),
                          max_tokens_field(body, "max_completion_tokens", "max_tokens"), bool(body.get("stream")),
                          model_name(body), {"include_usage": bool(opts.get("include_usage"))})


def _usage(turn: Turn) -> dict:
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens}


def answer(turn: Turn, req: NeutralRequest, token: str) -> dict:
    """The ``chat.completion`` object of ``turn``."""
    return {"id": f"chatcmpl-{token[:8]}-{turn.index}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model, "choices": [{"index": 0, "message": turn.message, "finish_reason": turn.finish,
                                             "logprobs": None}], "usage": _usage(turn)}


class Stream:
    """The server-sent events of one streamed completion (``index``: the turn's number)."""

    def __init__(self, req: NeutralRequest, token: str, index: int, prompt_tokens: int):
        self.req, self.id, self.created = req, f"chatcmpl-{token[:8]}-{index}", int(time.time())

    def _chunk(self, delta: dict, finish: str | None = None) -> str:
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.req.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    def opening(self) -> list[str]:
        """Events sent before the sampler answers: the role."""
        return [self._chunk({"role": "assistant", "content": ""})]

    def turn(self, turn: Turn) -> list[str]:
        """Events of the sampled turn, through ``[DONE]``."""
        out = [self._chunk({"content": piece}) for piece in text_pieces(turn.message.get("content") or "")]
        for k, call in enumerate(turn.message.get("tool_calls") or []):
            fn = call["function"]
            out.append(self._chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                                    "function": {"name": fn["name"], "arguments": ""}}]}))
            out += [self._chunk({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
                    for piece in text_pieces(fn["arguments"])]
        out.append(self._chunk({}, turn.finish))
        if self.req.options.get("include_usage"):
            out.append(sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                            "model": self.req.model, "choices": [], "usage": _usage(turn)}))
        return out + [sse("[DONE]")]

    def error(self, e: RequestError) -> list[str]:
        """An error after the stream opened."""
        return [sse(error_body(e)), sse("[DONE]")]


def error_body(e: RequestError) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": str(e), "type": "invalid_request_error" if e.status < 500 else "server_error",
                      "param": e.param, "code": e.code}}
