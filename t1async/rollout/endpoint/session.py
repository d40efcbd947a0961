"""One episode's session on the endpoint: a dialect's neutral request in, one sampled and recorded turn out.

A turn has two halves so that a streamed answer can open before the sampler runs:
:meth:`Session.prepare` checks the request against the run's limits and renders its prompt
(t1async/rollout/endpoint/recorder.py); :meth:`Session.generate` calls the sampler and records the
completion (rendering the prompt again if another request of the session was prepared in between).
Each holds the session's lock, so requests of one session are served one at a time, and the record
of a turn exists as soon as its ids are sampled, whatever the client does after that.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from loguru import logger

from t1async.rollout.endpoint.recorder import (
    ChatRecorder,
    CompletionRecord,
    RequestError,
    completion_message,
    template_completion_message,
)
from t1async.sampling.sampler_client import Sampler, SamplerError


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
class NeutralRequest:
    """A dialect's request reduced to what the recorder and the sampler need.

    Attributes:
        messages: the conversation as OpenAI Chat Completions messages (the recorder's neutral shape).
        tools: the declared tools as JSON-schema function specs (``{"name", "description", "parameters"}``).
        max_new_tokens: the request's own cap (None: the run's ``generation.max_new_tokens``).
        stream: the client asked for server-sent events.
        model: the model name the client sent (echoed in the answer).
        options: dialect fields to echo in the answer (``stream_options.include_usage`` of chat).
    """

    messages: list[dict]
    tools: list[dict]
    max_new_tokens: int | None = None
    stream: bool = False
    model: str = "t1async"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Turn:
    """One sampled turn, as every dialect answers it.

    Attributes:
        index: the turn's number in the episode (0-based): answer and call ids derive from it.
        message: the neutral assistant message (``content`` text or None, ``tool_calls``).
        record: what was recorded (prompt ids, sampled ids, log-probs, routed experts, weight version).
        finish: ``stop``, ``tool_calls`` or ``length``.
    """

    index: int
    message: dict
    record: CompletionRecord
    finish: str

    @property
    def prompt_tokens(self) -> int:
        return len(self.record.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.record.output_ids)


@dataclass
class Ticket:
    """A streamed request's link between the sampling thread and the stream: whichever of "sampled"
    and "client gone" comes second marks the record (:meth:`Session.disconnected`)."""

    turn: Turn | None = None
    gone: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Prepared:
    """A request whose prompt is rendered and whose session lock is held (:meth:`Session.prepare`)."""

    request: NeutralRequest
    ids: list[int]
    segment: int
    start: int
    params: dict[str, Any]
    index: int


def check_settings(limits: SessionLimits, settings: dict[str, Any]) -> None:
    """Refuse sampling settings other than the run's: the learner scores the sampled tokens under
    ``generation.*``, so a turn sampled otherwise would carry wrong importance weights.

    Args:
        settings: request field name -> (value, generation key); a None value is "not sent".

    Raises:
        RequestError: naming the field, the run's value and what to send instead.
    """
    for field_name, (value, key) in settings.items():
        if value is None:
            continue
        run = limits.sampling_params.get(key)
        if key == "top_k" and (run is None or int(run) < 1):
            raise RequestError(f"{field_name}={value}: the run samples without top-k (generation.top_k={run}) and "
                               f"the learner scores tokens under it; omit {field_name}", param=field_name)
        try:
            same = abs(float(value) - float(run)) <= 1e-9
        except (TypeError, ValueError):
            raise RequestError(f"{field_name}={value!r} is not a number", param=field_name) from None
        if not same:
            raise RequestError(f"{field_name}={value} differs from the run's generation.{key}={run}: the learner "
                               f"scores tokens under it; omit {field_name} or send {run}", param=field_name)


def refuse_set(body: dict, fields: dict[str, str]) -> None:
    """Refuse the first of ``fields`` (name -> why) that ``body`` sets to something other than
    null/false/empty (naming the field).

    Raises:
        RequestError: one line naming the field and why it is not served.
    """
    for name, why in fields.items():
        value = body.get(name)
        if value not in (None, False, "", [], {}):
            raise RequestError(f"{name} is not supported by the t1async endpoint: {why}", param=name)


@dataclass
class Session:
    """One episode's state on the endpoint (built by :meth:`AgentEndpoint.open`).

    Attributes:
        ended: set when the episode is over for the agent: ``end_signal`` (it called done),
            ``max_turns``, ``context_full``; None while it runs. Every later request gets HTTP 409.
        done: set when ``ended`` is.
        sampler_errors: completions answered 502 because the sampler failed.
        disconnects: streamed answers the client closed before their last event.
        dialects: completions served per dialect (``chat``, ``responses``, ``messages``).
        hosted_tools_left_out: hosted tools a request declared that were not shown to the model (this
            server runs none), by name, counted per request.
    """

    token: str
    sampler: Sampler
    execute: Callable[[str], Any]
    limits: SessionLimits
    recorder: ChatRecorder
    ended: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    sampler_errors: int = 0
    disconnects: int = 0
    dialects: dict[str, int] = field(default_factory=dict)
    hosted_tools_left_out: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _prepared: Prepared | None = None

    def end(self, reason: str) -> None:
        """End the episode for the agent (the first reason given stays) and wake who waits on :attr:`done`."""
        if self.ended is None:
            self.ended = reason
        self.done.set()

    def prepare(self, req: NeutralRequest) -> Prepared:
        """Check ``req`` against the episode and render its prompt (the stream can open on it).

        Raises:
            RequestError: the episode over (409), its turns spent (409, ends it), a message the
                template cannot render, the context full (400 ``context_length_exceeded``, ends it).
        """
        with self.lock:
            for name in req.options.get("hosted_tools_left_out", ()):
                if name not in self.hosted_tools_left_out:
                    logger.warning("hosted tool {!r} is not served (the harness's own tools are): left out of the "
                                   "prompt, counted per request", name)
                self.hosted_tools_left_out[name] = self.hosted_tools_left_out.get(name, 0) + 1
            return self._prepare(req)

    def _prepare(self, req: NeutralRequest) -> Prepared:
        params = dict(self.limits.sampling_params)
        if req.max_new_tokens is not None:
            params["max_new_tokens"] = min(int(req.max_new_tokens), params["max_new_tokens"])
        if self.ended is not None:
            raise RequestError(f"the episode is over ({self.ended}); exit", status=409, code="episode_over")
        if len(self.recorder.records) >= self.limits.max_turns:
            self.end("max_turns")
            raise RequestError(f"the episode's {self.limits.max_turns} turns are spent; exit", status=409,
                               code="episode_over")
        ids, segment, start = self.recorder.prompt(req.messages, req.tools)
        if len(ids) + params["max_new_tokens"] > self.limits.context_tokens:
            self.end("context_full")
            raise RequestError(f"the prompt ({len(ids)} tokens) plus max tokens ({params['max_new_tokens']}) "
                               f"exceeds the context of {self.limits.context_tokens} tokens",
                               code="context_length_exceeded")
        params["stop_token_ids"] = list(self.recorder.stop_ids)
        self._prepared = Prepared(req, ids, segment, start, params, len(self.recorder.records))
        return self._prepared

    def generate(self, prepared: Prepared, dialect: str, ticket: "Ticket | None" = None) -> Turn:
        """Sample the prepared prompt, record the completion; the neutral answer. A request of the same
        session prepared in between (the recorder's state moved) has this one's prompt rendered again.

        Raises:
            RequestError: as :meth:`prepare`; the sampler failing or answering no tokens (502 ``sampler_error``).
        """
        with self.lock:
            if self._prepared is not prepared:
                prepared = self._prepare(prepared.request)
            self._prepared = None
            req, ids, start = prepared.request, prepared.ids, prepared.start
            try:
                resp = self.sampler.generate(ids, prepared.params, routed_experts_start_len=start)
            except SamplerError as e:
                self.sampler_errors += 1
                raise RequestError(f"the sampler failed: {e}", status=502, code="sampler_error") from None
            if not resp.output_ids:
                self.sampler_errors += 1
                raise RequestError(f"the sampler answered no tokens ({resp.finish_reason})", status=502,
                                   code="sampler_error")
            tok, stops = self.recorder.tok, self.recorder.stop_ids
            body = resp.output_ids[:-1] if resp.output_ids[-1] in stops else resp.output_ids
            turn = len(self.recorder.records)
            if self.recorder.template is not None:
                message, status = template_completion_message(tok, body, req.tools, f"call_{turn}")
            else:
                message, status = completion_message(tok, body, {t["name"] for t in req.tools}, f"call_{turn}")
            record = CompletionRecord(prepared.segment, ids, list(resp.output_ids), list(resp.logprobs),
                                      resp.routed_experts, start, resp.weight_version, resp.finish_reason, status)
            self.recorder.add(record, req.messages, message, req.tools)
            self.dialects[dialect] = self.dialects.get(dialect, 0) + 1
            finish = ("length" if resp.finish_reason == "length" else
                      "tool_calls" if message.get("tool_calls") else "stop")
            out = Turn(turn, message, record, finish)
            if ticket is not None:
                with ticket.lock:
                    record.client_disconnected = ticket.gone
                    ticket.turn = out
        return out

    def complete(self, req: NeutralRequest, dialect: str) -> Turn:
        """:meth:`prepare` then :meth:`generate` (an answer that is not streamed)."""
        return self.generate(self.prepare(req), dialect)

    def disconnected(self, ticket: "Ticket") -> None:
        """The client closed the stream of ``ticket``'s request before its last event: counted once, and
        its turn's record is marked (now, or when the sampler answers: its tool calls never reached the
        client). Never blocks (called on the server's event loop)."""
        with ticket.lock:
            if ticket.gone:
                return
            ticket.gone = True
            self.disconnects += 1
            if ticket.turn is not None:
                ticket.turn.record.client_disconnected = True

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


def text_pieces(text: str, size: int = 16) -> Sequence[str]:
    """``text`` cut into pieces of at most ``size`` characters (the deltas of a streamed answer)."""
    return [text[i:i + size] for i in range(0, len(text), size)]


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event (``event:`` line when named, ``data:`` the JSON of ``data`` or a string as is)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def model_name(body: dict) -> str:
    """The ``model`` the client sent (echoed back), or ``t1async``."""
    m = body.get("model")
    return m if isinstance(m, str) and m else "t1async"


def max_tokens_field(body: dict, *names: str) -> int | None:
    """The first of ``names`` that ``body`` sets, as an int >= 1 (None: none set).

    Raises:
        RequestError: not an integer >= 1 (naming the field).
    """
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise RequestError(f"{name}={v!r} must be an integer >= 1", param=name)
        return v
    return None
