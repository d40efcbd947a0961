"""The HTTP surface: one FastAPI app (uvicorn on a thread) per rollout actor, three dialects per session.

Routes, under a per-episode base URL ``http://HOST:PORT/s/<session>`` (the session token keeps a
straggling agent of an earlier episode out of the next one):

- ``POST /v1/chat/completions``: OpenAI Chat Completions (t1async/rollout/endpoint/chat.py);
- ``POST /v1/responses``: OpenAI Responses (responses.py; Codex CLI);
- ``POST /v1/messages``: Anthropic Messages (messages.py; Claude Code); ``POST
  /v1/messages/count_tokens``: the prompt's length as rendered from scratch;
- ``GET /v1/models``: the one model, ``t1async``;
- ``POST /sandbox/exec`` ``{"command": str}`` -> ``{"output", "exit_code", "timed_out"}``: runs the
  command in the episode's sandbox shell (for agents that do not run their own commands);
- ``POST /done``: the agent says the task is done (the verifier runs).

Each dialect parses its body into the neutral request and answers from the one recorder's turn
(t1async/rollout/endpoint/session.py). A streamed answer opens (status 200 and the dialect's first
events) once the prompt is rendered, then the sampler runs; a client that closes the stream before
the last event leaves the sampled turn recorded and marked (``client_disconnected``) and is counted.
Refusals come in the dialect's own error shape and are counted by code (:attr:`AgentEndpoint.rejected`).
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from types import ModuleType
from typing import Any, Callable

from loguru import logger

from t1async import require_extra
from t1async.models.chat_template import ChatTemplateRenderer
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.endpoint import chat, messages, responses
from t1async.rollout.endpoint.recorder import ChatRecorder, RequestError, template_message
from t1async.rollout.endpoint.session import Session, SessionLimits, Ticket
from t1async.sampling.sampler_client import Sampler

# fastapi and uvicorn come with the extra `endpoint`: without them, one line saying so
ENDPOINT_EXTRA = ("endpoint", "the agent endpoint (rollout.agent other than builtin)")
_fastapi = require_extra("fastapi", *ENDPOINT_EXTRA)
FastAPI, Request = _fastapi.FastAPI, _fastapi.Request
_responses = require_extra("fastapi.responses", *ENDPOINT_EXTRA)
JSONResponse, StreamingResponse = _responses.JSONResponse, _responses.StreamingResponse
run_in_threadpool = require_extra("starlette.concurrency", *ENDPOINT_EXTRA).run_in_threadpool
to_thread = require_extra("anyio.to_thread", *ENDPOINT_EXTRA)

DIALECTS: dict[str, ModuleType] = {"chat/completions": chat, "responses": responses, "messages": messages}
"""Route under ``/v1/`` -> dialect module (``NAME``, ``parse``, ``answer``, ``Stream``, ``error_body``)."""


class AgentEndpoint:
    """The HTTP surface, one per rollout actor.

    Args:
        tokenizer: the run's renderer (t1async/models/families.py ``load_renderer``): the shipped
            ChatML tokenizer, or a model folder's ``ChatTemplateRenderer`` (its own template and tool format).
        host: interface to listen on; the port is a free one (:attr:`url`).

    Attributes:
        url: ``http://host:port``.
        rejected: requests answered with an error, by error code.
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
                                        name="agent-endpoint")
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the agent endpoint did not start on {self.url}")
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

    def _count(self, e: RequestError) -> None:
        with self._lock:
            self.rejected[e.code] = self.rejected.get(e.code, 0) + 1

    def _app(self) -> Any:
        app = FastAPI(title="t1async agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(RequestError)
        async def _refused(request: Request, e: RequestError) -> JSONResponse:
            self._count(e)
            dialect = messages if "/v1/messages" in request.url.path else chat
            return JSONResponse(dialect.error_body(e), status_code=e.status)

        async def _body(request: Request) -> dict:
            try:
                body = await request.json()
            except ValueError:
                raise RequestError("the body is not JSON") from None
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            return body

        def _call(fn: Callable, *args: Any) -> Any:
            try:
                return fn(*args)
            except RequestError:
                raise
            except (TypeError, ValueError, KeyError, AttributeError) as e:  # ill-typed fields: the agent's fault
                logger.opt(exception=e).warning("refused a request with ill-typed fields")
                raise RequestError(f"bad request: {type(e).__name__}: {e}") from None

        async def _serve(token: str, request: Request, dialect: ModuleType) -> Any:
            s, body = self._session(token), await _body(request)
            req = _call(dialect.parse, body, s.limits)
            if not req.stream:
                turn = await run_in_threadpool(_call, s.complete, req, dialect.NAME)
                return dialect.answer(turn, req, s.token)
            prepared = await run_in_threadpool(_call, s.prepare, req)
            stream = dialect.Stream(req, s.token, prepared.index, len(prepared.ids))
            return StreamingResponse(self._events(s, stream, prepared, dialect.NAME), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        def _route(dialect: ModuleType) -> Callable:
            async def handler(token: str, request: Request) -> Any:
                return await _serve(token, request, dialect)
            return handler

        for route, dialect in DIALECTS.items():
            app.post(f"/s/{{token}}/v1/{route}")(_route(dialect))

        @app.post("/s/{token}/v1/messages/count_tokens")
        async def count_tokens(token: str, request: Request) -> Any:
            s, body = self._session(token), await _body(request)
            req = _call(messages.parse, {"max_tokens": 1, **body}, s.limits)
            ids = await run_in_threadpool(_call, self.tok.render_chat, [template_message(m) for m in req.messages],
                                          req.tools)
            return {"input_tokens": len(ids)}

        @app.get("/s/{token}/v1/models")
        async def models(token: str) -> Any:
            self._session(token)
            return {"object": "list", "data": [{"id": "t1async", "object": "model", "created": 0, "owned_by": "t1async"}]}

        @app.post("/s/{token}/sandbox/exec")
        async def sandbox_exec(token: str, request: Request) -> Any:
            s, body = self._session(token), await _body(request)
            return await run_in_threadpool(_call, s.exec, body)

        @app.post("/s/{token}/done")
        async def done(token: str) -> Any:
            self._session(token).end("end_signal")
            return {"ok": True}

        return app

    async def _events(self, s: Session, stream: Any, prepared: Any, dialect: str) -> Any:
        """The stream of one turn: the opening events, the sampler's turn (or an error event); a stream
        left before its end marks the turn (:meth:`Session.disconnected`)."""
        ticket, finished = Ticket(), False
        try:
            for event in stream.opening():
                yield event
            try:
                # abandoned when the client leaves: the sampler's thread records the turn, the ticket marks it
                turn = await to_thread.run_sync(s.generate, prepared, dialect, ticket, abandon_on_cancel=True)
            except RequestError as e:
                self._count(e)
                for event in stream.error(e):
                    yield event
                finished = True
                return
            events = stream.turn(turn)
            for event in events:
                yield event
            finished = True
        finally:
            if not finished:
                s.disconnected(ticket)
                logger.warning("a client closed its {} stream before the end; the sampled turn is kept and marked",
                               dialect)

    def shutdown(self) -> None:
        """Stop serving (waits up to 10 s for the server thread)."""
        self._server.should_exit = True
        self._thread.join(timeout=10)


OpenAIEndpoint = AgentEndpoint
"""The name it had when it spoke Chat Completions only."""
