"""An OpenAI-compatible chat endpoint in front of a sampler that records every completion token-exactly.

An external agent program (``rollout.agent: external``) drives an episode through this endpoint,
the way it would talk to any OpenAI-compatible server. Routes, under a per-episode base URL
``http://HOST:PORT/s/<session>`` (the session token keeps a straggling agent of an earlier episode
out of the next one):

- ``POST /s/<session>/v1/chat/completions``: OpenAI Chat Completions (``messages``, ``tools``,
  ``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``). Refused with HTTP 400
  and an OpenAI error body: ``stream: true`` (not supported), ``n`` > 1, ``stop`` strings, and a
  ``temperature`` / ``top_p`` other than the run's ``generation`` settings (the learner scores
  log-probs under those, so a completion sampled otherwise would carry wrong importance weights).
  ``max_tokens`` is capped at ``generation.max_new_tokens``.
- ``GET /s/<session>/v1/models``: the one model, ``t1async``.
- ``POST /s/<session>/sandbox/exec`` ``{"command": str}`` -> ``{"output", "exit_code",
  "timed_out"}``: runs the command in the episode's sandbox shell.
- ``POST /s/<session>/done``: the agent says the task is done (the verifier runs).

Rendering: one renderer, the run's (``render_chat`` for a segment's first request,
``render_continuation`` for the new messages after a completion): a model folder's
:class:`~t1async.models.chat_template.ChatTemplateRenderer` (its own template, tools declared its
way), or the shipped tokenizer's ChatML as Qwen3's template lays it out
(:meth:`ChatTokenizer.render_chat`), the same code the rollout loop and SFT use. The model's
tool calls, in the format its template declares (``<tool_call>`` JSON for the shipped tokenizer),
are returned as OpenAI ``tool_calls`` (``arguments`` a JSON string); a call that cannot be parsed
stays text in ``content`` and its turn is marked with a tool-call error code (t1async/trajectory.py).

Recording (TITO; :class:`ChatRecorder`). The prompt of a request is NOT re-rendered from the
agent's transcript when the transcript continues the previous completion: if the request's
messages are the previous request's messages, then the assistant message this endpoint returned,
then new messages, the prompt is the previous prompt + the exact sampled ids (+ ``<|im_end|>``
when the turn did not end with it) + the new messages rendered on their own. Any other history
(edited, truncated, re-ordered, a retry, a second conversation) is a *history break*: it is
counted, rendered from scratch and starts a new segment; each segment's records extend one
another exactly, so each segment is one exact trajectory (t1async/rollout/agent.py builds them).
Nothing sampled is ever re-tokenized.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
from loguru import logger

from t1async import require_extra
from t1async.models.chat_template import ChatTemplateRenderer
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.tool_formats import ToolCallProblem, detect, tag_ids
from t1async.sampling.sampler_client import Sampler, SamplerError
from t1async.trajectory import TOOL_CALL_CODES

# fastapi and uvicorn come with the extra `endpoint`: without them, one line saying so
ENDPOINT_EXTRA = ("endpoint", "the OpenAI-compatible endpoint (rollout.agent=external)")
_fastapi = require_extra("fastapi", *ENDPOINT_EXTRA)
FastAPI, Request = _fastapi.FastAPI, _fastapi.Request
JSONResponse = require_extra("fastapi.responses", *ENDPOINT_EXTRA).JSONResponse
run_in_threadpool = require_extra("starlette.concurrency", *ENDPOINT_EXTRA).run_in_threadpool

class RequestError(ValueError):
    """A request the endpoint refuses; ``status`` is the HTTP status, ``code`` the OpenAI error code."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code = status, code


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


# ---------------------------------------------------------------- one episode's session

@dataclass
class SessionLimits:
    """What one episode's agent may ask for.

    Attributes:
        sampling_params: the run's ``generation`` settings as SGLang ``sampling_params``
            (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``); a request may lower
            ``max_new_tokens`` but not change the rest.
        max_turns: completions per episode; the one after the last is refused and ends the episode.
        context_tokens: longest stream (prompt + ``max_new_tokens``) a completion may need.
    """

    sampling_params: dict[str, Any]
    max_turns: int
    context_tokens: int


@dataclass
class Session:
    """One episode's state on the endpoint (built by :meth:`OpenAIEndpoint.open`).

    Attributes:
        ended: set when the episode is over for the agent: ``end_signal`` (it called done),
            ``max_turns``, ``context_full``; None while it runs. Every later request gets HTTP 409.
        done: set when ``ended`` is.
        sampler_errors: completions answered 502 because the sampler failed.
    """

    token: str
    sampler: Sampler
    execute: Callable[[str], Any]
    limits: SessionLimits
    recorder: ChatRecorder
    ended: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    sampler_errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def end(self, reason: str) -> None:
        """End the episode for the agent (the first reason given stays) and wake who waits on :attr:`done`."""
        if self.ended is None:
            self.ended = reason
        self.done.set()

    def complete(self, req: dict) -> dict:
        """Answer one chat-completion request (OpenAI body in, ChatCompletion out); serialised per session.

        Raises:
            RequestError: a refused parameter, a bad message, the episode over (409), the context
                full (400 ``context_length_exceeded``, ends the episode), the sampler failing (502).
        """
        if req.get("stream"):
            raise RequestError("stream=true is not supported by the t1async endpoint; send stream=false")
        if int(req.get("n") or 1) != 1:
            raise RequestError("n > 1 is not supported; send one request per completion")
        if req.get("stop"):
            raise RequestError("stop strings are not supported; the turn ends at <|im_end|>")
        params = dict(self.limits.sampling_params)
        for key in ("temperature", "top_p"):
            v = req.get(key)
            if v is not None and abs(float(v) - float(params[key])) > 1e-9:
                raise RequestError(f"{key}={v} differs from the run's generation.{key}={params[key]}: the learner "
                                   f"scores tokens under it; omit {key} or send {params[key]}")
        cap = req.get("max_completion_tokens") or req.get("max_tokens")
        if cap is not None:
            if int(cap) < 1:
                raise RequestError(f"max_tokens={cap} must be >= 1")
            params["max_new_tokens"] = min(int(cap), params["max_new_tokens"])
        messages = req.get("messages")
        if not isinstance(messages, list):
            raise RequestError("messages must be a list of message objects")
        tools = tool_specs(req.get("tools"))
        with self.lock:
            if self.ended is not None:
                raise RequestError(f"the episode is over ({self.ended}); exit", status=409, code="episode_over")
            if len(self.recorder.records) >= self.limits.max_turns:
                self.end("max_turns")
                raise RequestError(f"the episode's {self.limits.max_turns} turns are spent; exit", status=409,
                                   code="episode_over")
            ids, segment, start = self.recorder.prompt(messages, tools)
            if len(ids) + params["max_new_tokens"] > self.limits.context_tokens:
                self.end("context_full")
                raise RequestError(f"the prompt ({len(ids)} tokens) plus max_tokens ({params['max_new_tokens']}) "
                                   f"exceeds the context of {self.limits.context_tokens} tokens",
                                   code="context_length_exceeded")
            tok, stops = self.recorder.tok, self.recorder.stop_ids
            params["stop_token_ids"] = list(stops)
            try:
                resp = self.sampler.generate(ids, params, routed_experts_start_len=start)
            except SamplerError as e:
                self.sampler_errors += 1
                raise RequestError(f"the sampler failed: {e}", status=502, code="sampler_error") from None
            if not resp.output_ids:
                self.sampler_errors += 1
                raise RequestError(f"the sampler answered no tokens ({resp.finish_reason})", status=502,
                                   code="sampler_error")
            body = resp.output_ids[:-1] if resp.output_ids[-1] in stops else resp.output_ids
            turn = len(self.recorder.records)
            if self.recorder.template is not None:
                message, status = template_completion_message(tok, body, tools, f"call_{turn}")
            else:
                message, status = completion_message(tok, body, {t["name"] for t in tools}, f"call_{turn}")
            self.recorder.add(CompletionRecord(segment, ids, list(resp.output_ids), list(resp.logprobs),
                                               resp.routed_experts, start, resp.weight_version, resp.finish_reason,
                                               status), messages, message, tools)
        finish = {"length": "length"}.get(resp.finish_reason, "tool_calls" if message.get("tool_calls") else "stop")
        return {"id": f"chatcmpl-{self.token[:8]}-{turn}", "object": "chat.completion", "created": int(time.time()),
                "model": "t1async", "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                 "logprobs": None}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(resp.output_ids),
                          "total_tokens": len(ids) + len(resp.output_ids)}}

    def exec(self, req: dict) -> dict:
        """Run ``req["command"]`` in the sandbox shell: ``{"output", "exit_code", "timed_out"}``.

        Raises:
            RequestError: no command string, or the episode is over (409).
        """
        command = req.get("command")
        if not isinstance(command, str):
            raise RequestError('the body must be {"command": "<shell command>"}')
        with self.lock:  # one at a time with completions; the episode waits for it before the verifier
            if self.ended is not None:
                raise RequestError(f"the episode is over ({self.ended}); exit", status=409, code="episode_over")
            result = self.execute(command)
        return {"output": result.output, "exit_code": int(result.exit_code), "timed_out": bool(result.timed_out)}


# ---------------------------------------------------------------- the HTTP server

class OpenAIEndpoint:
    """The HTTP surface (FastAPI app served by uvicorn on a thread), one per rollout actor.

    Args:
        tokenizer: the run's renderer (t1async/models/families.py ``load_renderer``): the shipped
            ChatML tokenizer, or a model folder's ``ChatTemplateRenderer`` (its own template and tool format).
        host: interface to listen on; the port is a free one (:attr:`url`).

    Attributes:
        url: ``http://host:port``.
        rejected: requests answered with an error, by OpenAI error code.
    """

    def __init__(self, tokenizer: ChatTokenizer | ChatTemplateRenderer, host: str = "127.0.0.1"):
        uvicorn = require_extra("uvicorn", *ENDPOINT_EXTRA)

        self.tok = tokenizer
        self.sessions: dict[str, Session] = {}
        self.rejected: dict[str, int] = {}
        self._lock = threading.Lock()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self._app(), log_level="warning", access_log=False,
                                                    log_config=None))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="openai-endpoint")
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the OpenAI endpoint did not start on {self.url}")
            time.sleep(0.01)

    def open(self, sampler: Sampler, execute: Callable[[str], Any], limits: SessionLimits) -> Session:
        """A new episode's session; its base URL is ``{url}/s/{session.token}``."""
        s = Session(secrets.token_hex(16), sampler, execute, limits, ChatRecorder(self.tok))
        with self._lock:
            self.sessions[s.token] = s
        return s

    def close_session(self, session: Session) -> None:
        """Forget a session (later requests with its token get 404)."""
        with self._lock:
            self.sessions.pop(session.token, None)

    def _session(self, token: str) -> Session:
        s = self.sessions.get(token)
        if s is None:
            raise RequestError("unknown or finished session; use the base URL of the current episode", status=404,
                               code="unknown_session")
        return s

    def _app(self) -> Any:
        app = FastAPI(title="t1async OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(RequestError)
        async def _refused(request: Request, e: RequestError) -> JSONResponse:
            with self._lock:
                self.rejected[e.code] = self.rejected.get(e.code, 0) + 1
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "code": e.code}},
                                status_code=e.status)

        async def _body(request: Request) -> dict:
            try:
                body = await request.json()
            except ValueError:
                raise RequestError("the body is not JSON") from None
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            return body

        def _call(fn: Callable[[dict], dict], body: dict) -> dict:
            try:
                return fn(body)
            except RequestError:
                raise
            except (TypeError, ValueError, KeyError, AttributeError) as e:  # ill-typed fields: the agent's fault
                logger.opt(exception=e).warning("refused a request with ill-typed fields")
                raise RequestError(f"bad request: {type(e).__name__}: {e}") from None

        async def _threaded(token: str, request: Request, method: str) -> dict:
            """Run a session method on the body in a worker thread (it blocks on the sampler or the shell)."""
            s, body = self._session(token), await _body(request)
            return await run_in_threadpool(_call, getattr(s, method), body)

        @app.post("/s/{token}/v1/chat/completions")
        async def chat(token: str, request: Request) -> Any:
            return await _threaded(token, request, "complete")

        @app.get("/s/{token}/v1/models")
        async def models(token: str) -> Any:
            self._session(token)
            return {"object": "list", "data": [{"id": "t1async", "object": "model", "created": 0, "owned_by": "t1async"}]}

        @app.post("/s/{token}/sandbox/exec")
        async def sandbox_exec(token: str, request: Request) -> Any:
            return await _threaded(token, request, "exec")

        @app.post("/s/{token}/done")
        async def done(token: str) -> Any:
            self._session(token).end("end_signal")
            return {"ok": True}

        return app

    def shutdown(self) -> None:
        """Stop serving (waits up to 10 s for the server thread)."""
        self._server.should_exit = True
        self._thread.join(timeout=10)
