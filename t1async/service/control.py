"""Control of a running service by its run directory: ``t1async status | stop | scale RUN_DIR``.

Channel: a ZeroMQ ROUTER socket (answering REQ clients) owned by the launch process (the run directory's holder, see
t1async/service/rundir.py), bound on ``transport.host`` at a free TCP port written to
``RUN_DIR/service.json`` as ``control``. Why this and not a Ray named actor: the launch process
already holds every role's handle and the run directory's lock, so it is the one place that can
answer for the whole service (and it is alive exactly as long as the service is); a command needs
no ``ray.init`` (5 s, and the right cluster address) and works from any machine that sees the run
directory and reaches the host, as the trajectory socket does; ZeroMQ is already a dependency.

Protocol: one JSON request, one JSON reply. Requests: ``{"cmd": "status"}``,
``{"cmd": "stop", "now": bool}``, ``{"cmd": "scale", "changes": {"rollout.num_actors": 4}, "force": bool}``
(``force``: past what the cluster can hold, t1async/service/capacity.py).
Replies: ``{"ok": true, ...}`` or ``{"ok": false, "error": "one line"}``. Any message gets a reply,
a malformed one (several frames, not JSON, too large) an error, and the socket keeps serving
(:class:`ControlServer`).

Live-changeable settings are the short list :data:`LIVE_KEYS`; anything else is refused with the
reason. The CLI here only formats: every decision is taken by the service (t1async/service/launch.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from t1async.service.rundir import describe_holder, is_held, read_service

LIVE_KEYS = {
    "rollout.num_actors": "rollout actors (started or retired at once; a retired actor finishes its episode)",
    "sampler.num_samplers": "embedded samplers (a new one serves once it holds the current weights; a removed "
                            "one is drained and leaves the weight group)",
    "learner.max_staleness": "staleness bound eta (admission and the learner's drop)",
    "learner.lr": "policy learning rate (from the next step)",
    "learner.max_steps": "step budget (0: run until stopped)",
    "env.tasks": "task names episodes are drawn from (from the next admission; must exist in env.tasks_dir)",
}
"""Settings ``t1async scale`` may change while the service runs, and what changing them does."""

REQUEST_TIMEOUT_S = 15.0


class ControlError(Exception):
    """A control command could not be carried out (no such run, stopped, refused); one line."""


def _config_key_error(key: str) -> str | None:
    """Why dotted ``key`` names no setting of :class:`~t1async.config.Config` (None: it names one)."""
    from t1async.config import Config  # (t1async.config and its yaml: deferred, status and stop stay light)

    node: Any = Config()
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = getattr(node, "__dataclass_fields__", None)
        if fields is None or part not in fields:
            where = ".".join(parts[:i]) or "the top level"
            return f"{key} is not a config key; valid keys of {where}: {', '.join(fields or [])}"
        node = getattr(node, part)
    if hasattr(node, "__dataclass_fields__"):
        return f"{key} is a config section, not a key; give one of its keys, e.g. {key}.{next(iter(vars(node)))}"
    return None


def live_change_refusal(key: str) -> str | None:
    """Why ``key`` cannot change live (None: it can): not a config key at all (with the valid keys
    where it went wrong), or one the roles read once (with why, and how to change it on a resume)."""
    if key in LIVE_KEYS:
        return None
    unknown = _config_key_error(key)
    if unknown is not None:
        return f"{unknown}. Live keys: {', '.join(LIVE_KEYS)}"
    section = key.split(".", 1)[0]
    why = {
        "model": "the weights' shapes are fixed for the run",
        "transport": "sockets and spools are bound when the roles start",
        "weight_sync": "the weight group is formed when the roles start",
        "run": "the run directory and seeds are fixed for the run",
        "ray": "Ray is started once per run",
    }.get(section, "the roles read it once when they start")
    return (f"{key} cannot change live: {why}; change it on a resume (t1async launch CONFIG run.dir=RUN_DIR "
            f"learner.resume=true {key}=VALUE). Live keys: {', '.join(LIVE_KEYS)}")


def parse_changes(pairs: list[str]) -> dict[str, Any]:
    """``["rollout.num_actors=4"]`` -> ``{"rollout.num_actors": 4}`` (values parsed as YAML).

    Raises:
        ControlError: not ``key=value``, or a key that cannot change live (with the reason).
    """
    import yaml  # (yaml: deferred, status and stop stay light)

    if not pairs:
        raise ControlError("give at least one key=value, e.g. rollout.num_actors=4")
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ControlError(f"{pair!r} is not key=value (for example rollout.num_actors=4)")
        refusal = live_change_refusal(key.strip())
        if refusal:
            raise ControlError(refusal)
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ControlError(f"{pair!r}: the value is not valid YAML") from None
    return out


# ---- server (in the launch process) ---------------------------------------------------------
MAX_REQUEST_BYTES = 64 << 10
"""Largest control request answered (bytes); a larger one gets an error reply. Requests are a
few hundred bytes; a message over :data:`MAX_FRAME_BYTES` is refused by ZeroMQ itself, which drops
that sender's connection (it cannot be answered; the socket keeps serving the others)."""
MAX_FRAME_BYTES = 1 << 20


def parse_request(parts: list[bytes]) -> dict[str, Any]:
    """The request carried by a control message's frames (after the envelope), or an error.

    Args:
        parts: the message's payload frames (one for a well-formed request).

    Returns:
        The request, a dict with a string ``cmd``.

    Raises:
        ControlError: one line saying what is wrong with the message (several frames, too large,
            not UTF-8 JSON, not a JSON object, no ``cmd``).
    """
    if len(parts) != 1:
        raise ControlError(f"a control request is one JSON frame, this message has {len(parts)}")
    raw = parts[0]
    if len(raw) > MAX_REQUEST_BYTES:
        raise ControlError(f"a control request is at most {MAX_REQUEST_BYTES} bytes, this one is {len(raw)}")
    try:
        req = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ControlError(f"a control request is UTF-8 JSON, this one starts {raw[:20]!r}") from None
    if not isinstance(req, dict) or not isinstance(req.get("cmd"), str):
        raise ControlError('a control request is a JSON object with a "cmd" string, e.g. {"cmd": "status"}')
    return req


LOG_FIRST, LOG_EVERY = 10, 100
"""Refused control requests logged: each of the first ``LOG_FIRST``, then every ``LOG_EVERY``-th (with the count)."""


class ControlServer:
    """Answers control requests from a daemon thread, one at a time, whatever a client sends.

    A ZeroMQ ROUTER socket (not REP, whose strict receive-then-send cycle a malformed message can
    break for good): every message gets a reply, a well-formed one its handler's, anything else
    (several frames, too large, not JSON, not an object, an unknown command) ``{"ok": false,
    "error": "one line"}``; a reply to a client that is gone or never reads is dropped, never
    waited for. A REQ client (:func:`request`) and a DEALER client (no empty delimiter frame) are
    both answered in their own envelope. Messages over :data:`MAX_FRAME_BYTES` drop the sender's
    connection (ZeroMQ ``MAXMSGSIZE``) and get no reply.

    Args:
        host: interface to bind (``transport.host``).
        handlers: ``{cmd: fn(request) -> reply dict}``; an exception becomes ``{"ok": false,
            "error": str(e)}`` (a handler raises with a one-line message).
    """

    def __init__(self, host: str, handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]):
        self.handlers = handlers
        self.answered = 0  # messages answered (well-formed or not)
        self.refused = 0  # of them, refused with an error reply (logged: the first LOG_FIRST, then every LOG_EVERY-th)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 64)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="control", daemon=True)
        self._thread.start()

    def answer(self, parts: list[bytes]) -> dict[str, Any]:
        """The reply to one message's payload ``parts`` (never raises)."""
        try:
            req = parse_request(parts)
            fn = self.handlers.get(req["cmd"])
            if fn is None:
                return {"ok": False, "error": f"unknown command {req['cmd']!r}; commands: {', '.join(self.handlers)}"}
            return fn(req)
        except Exception as e:  # a bad request must not end the service
            from loguru import logger  # (loguru: deferred, the client commands stay light)

            self.refused += 1
            if self.refused <= LOG_FIRST or self.refused % LOG_EVERY == 0:  # a flood of garbage: not a line each
                logger.warning("control request refused ({} so far): {}", self.refused, e)
            return {"ok": False, "error": str(e).splitlines()[0] if str(e) else type(e).__name__}

    def _loop(self) -> None:
        """Consumes one message at a time; produces one reply each. Stopped by :meth:`close`."""
        while not self._stop.is_set():
            try:
                if not self._sock.poll(200):
                    continue
                frames = self._sock.recv_multipart()
                # [peer, b"", payload...] from REQ; [peer, payload...] from DEALER
                envelope = frames[:2] if len(frames) > 1 and frames[1] == b"" else frames[:1]
                reply = self.answer(frames[len(envelope):])
                try:
                    body = json.dumps(reply, default=str).encode()
                except (TypeError, ValueError) as e:
                    body = json.dumps({"ok": False, "error": f"the reply could not be encoded: {e}"}).encode()
                self._sock.send_multipart([*envelope, body], flags=zmq.NOBLOCK)
                self.answered += 1
            except zmq.Again:
                continue  # the client's queue is full (it never reads): its reply is dropped
            except Exception as e:  # never let one message end the thread
                if self._stop.is_set():
                    return
                from loguru import logger  # (loguru: deferred, the client commands stay light)

                logger.opt(exception=e).error("control socket: a message could not be answered")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()


# ---- client ---------------------------------------------------------------------------------
def request(run_dir: str | Path, msg: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """Send ``msg`` to the service holding ``run_dir``; its reply (``ok`` true).

    Raises:
        ControlError: no such run directory, no service running there, no answer in time, or the
            service refused (its one-line reason).
    """
    d = Path(run_dir)
    if not d.is_dir():
        raise ControlError(f"no run directory {d}")
    info = read_service(d)
    if not is_held(d):
        where = f"; its summary is {d / 'summary.json'}" if (d / "summary.json").exists() else ""
        raise ControlError(f"the run in {d} is not running (stopped or never started){where}")
    if not info or "control" not in info:
        raise ControlError(f"the run in {d} is starting ({describe_holder(info)}); try again in a few seconds")
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(info["control"])
        sock.send(json.dumps(msg).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise ControlError(f"the run in {d} ({describe_holder(info)}) did not answer within {timeout_s:.0f} s")
        reply = json.loads(sock.recv())
    finally:
        sock.close()
    if not reply.get("ok"):
        raise ControlError(reply.get("error", "refused"))
    return reply


# ---- formatting -----------------------------------------------------------------------------
def drops_line(st: dict[str, Any]) -> str:
    """The status table's drop counters: stale drops and, of them, ``stale_restart`` (sampled by an
    earlier learner life's or a joining sampler's publication: 0 by design, docs/training.md) always
    shown, every other reason when it is not 0 (``dropped`` by reason, t1async/learner/abnormal.py)."""
    dropped = dict(st.get("dropped") or {})
    shown = {"stale": dropped.pop("stale", st.get("dropped_stale", 0)), "stale_restart": st.get("dropped_stale_restart", 0)}
    shown.update({k: v for k, v in dropped.items() if v})
    return f"{sum(v for k, v in shown.items() if k != 'stale_restart')} {json.dumps(shown)}"


def format_status(st: dict[str, Any]) -> str:
    """A human table of a status reply (rich, rendered to plain text)."""
    from rich.console import Console  # (rich: deferred to the table, status --json and stop stay light)
    from rich.table import Table  # (rich)

    def f(x: Any, nd: int = 2) -> str:
        return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)

    head = Table.grid(padding=(0, 2))
    rows = [
        ("run", st.get("run_dir")),
        ("state", st.get("state") + (f" (learner: {st['learner_error']})" if st.get("learner_error") else "")),
        ("step / version", f"{st.get('step')} / v{st.get('version')}"
                           f"  (max_steps {st.get('max_steps') or 'unlimited'})"),
        ("since last step", f"{f(st.get('since_last_step_s'), 1)} s"),
        ("trajectories/s", f(st.get("trajectories_per_s"))),
        ("reward (recent / before)", f"{f(st.get('reward_recent'))} / {f(st.get('reward_before'))}"),
        ("resolved (recent / before)", f"{f(st.get('resolved_recent'))} / {f(st.get('resolved_before'))}"),
        ("staleness max / bound", f"{st.get('staleness_max')} / {st.get('max_staleness')}"),
        ("queue", st.get("queue_depth")),
        ("dropped", drops_line(st)),
        ("rejected (quarantined)", f"{st.get('rejected', 0)} {json.dumps(st.get('rejected_by') or {})}"),
        ("refused connections", json.dumps({k: v for k, v in (st.get("refused_handshakes") or {}).items() if v})),
        ("episode failures", json.dumps(st.get("episode_failures") or {})
         + (f" by agent {json.dumps(st['episode_failures_by_agent'])}" if st.get("episode_failures_by_agent") else "")),
        ("restarts", json.dumps(st.get("restarts") or {})),
        ("memory", (st.get("memory") or {}).get("line", "-")),
    ]
    for k, v in rows:
        head.add_row(k, str(v))
    roles = Table("role", "state", "version", "episodes / requests", "restarts")
    for a in st.get("actors", []):
        roles.add_row(f"rollout{a['id']}", a["state"], f(a.get("version")), f(a.get("episodes")), "-")
    for s in st.get("samplers", []):
        state = s.get("state", "serving") + (f" ({s['error']})" if s.get("error") and s.get("state") != "serving" else "")
        roles.add_row(s.get("name", "sampler"), state[:60], f(s.get("weight_version")), f(s.get("requests")),
                      f(s.get("restarts")))
    console = Console(width=110, record=True, file=open("/dev/null", "w"))  # noqa: SIM115 (record only)
    console.print(head)
    console.print(roles)
    if st.get("by_agent"):  # the last 10 steps' trajectories by the agent that drove them
        agents = Table("agent", "trajectories", "reward", "resolved", "turns", "tokens", "history breaks",
                       "template mismatches", title="by agent, last 10 steps")
        for name, a in st["by_agent"].items():
            agents.add_row(name, str(a["trajectories"]), f(a["reward_mean"]), f(a["resolved_rate"]), f(a["turns_mean"], 1),
                           str(a["tokens"]), str(a["history_breaks"]), str(a["template_mismatches"]))
        console.print(agents)
    return console.export_text()


def register(sub: argparse._SubParsersAction) -> None:
    """``t1async status RUN_DIR [--json]``, ``t1async stop RUN_DIR [--now]``, ``t1async scale RUN_DIR key=value ...``."""
    p = sub.add_parser("status", help="show a running service: steps, rates, roles, drops")
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.set_defaults(func=run_status)
    p = sub.add_parser("stop", help="stop a running service: drain, final checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--now", action="store_true", help="do not wait for running episodes (nothing finished is lost)")
    p.set_defaults(func=run_stop)
    p = sub.add_parser("scale", help=f"change live settings: {', '.join(LIVE_KEYS)}")
    p.add_argument("run_dir")
    p.add_argument("changes", nargs="*", help="key=value, e.g. rollout.num_actors=4")
    p.add_argument("--force", action="store_true", help="scale rollout actors or samplers past what the Ray "
                                                        "cluster can hold (ray.role_memory_mb, ray.rollouts_per_cpu)")
    p.set_defaults(func=run_scale)


def run_status(args: argparse.Namespace) -> int:
    st = request(args.run_dir, {"cmd": "status"})
    st.pop("ok", None)
    print(json.dumps(st, default=str) if args.json else format_status(st))
    return 0


def final_checkpoint_error(summary: dict[str, Any]) -> str | None:
    """One line when a run's summary (``summary.json``) says its final checkpoint was not written
    (the learner's ``checkpoint_failed``: a full disk, ``did not fit``, or an I/O error), else None."""
    why = (summary.get("learner") or {}).get("checkpoint_failed") if isinstance(summary, dict) else None
    if not why:
        return None
    how = "did not fit" if "disk full" in why else "was not written"
    return (f"the final checkpoint {how}: {why}; nothing is lost: a resume starts from the last checkpoint "
            f"written and the receive log (free space, then t1async launch CONFIG run.dir={summary.get('run_dir')} "
            "learner.resume=true)")


def run_stop(args: argparse.Namespace) -> int:
    """Ask the service to stop and wait (up to 600 s) until it has: 0, or 1 (one line) when its
    final checkpoint was not written (:func:`final_checkpoint_error`), the launch ended with an
    error (``error`` in its summary: the learner died), it wrote no summary (killed), or it is
    still stopping."""
    asked_at = time.time()
    request(args.run_dir, {"cmd": "stop", "now": bool(args.now)})
    print(f"t1async: stopping the run in {args.run_dir}" + (" now" if args.now else " after its current step"))
    deadline = time.monotonic() + 600
    while is_held(Path(args.run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if is_held(Path(args.run_dir)):
        print("t1async: still stopping after 600 s")
        return 1
    path = Path(args.run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text()) if path.stat().st_mtime >= asked_at - 1 else None
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict):
        print(f"t1async: error: the service ended without writing {path} (killed, or its disk refused it); see "
              f"{Path(args.run_dir) / 'logs' / 't1async.log'}", file=sys.stderr)
        return 1
    error = final_checkpoint_error(summary)
    if summary.get("error"):
        print(f"t1async: error: stopped, but {summary['error']}", file=sys.stderr)
        return 1
    if error:
        print(f"t1async: error: stopped, but {error}", file=sys.stderr)
        return 1
    print("t1async: stopped")
    return 0


SCALE_TIMEOUT_S = 90.0
"""How long ``t1async scale`` waits for the service's answer: applying a change waits on the
controller, which on a loaded node starting many actors took over 15 s (the change was applied
after the command had said it failed)."""


def run_scale(args: argparse.Namespace) -> int:
    msg = {"cmd": "scale", "changes": parse_changes(args.changes), "force": bool(args.force)}
    try:
        reply = request(args.run_dir, msg, timeout_s=SCALE_TIMEOUT_S)
    except ControlError as e:
        if "did not answer within" not in str(e):
            raise
        raise ControlError(f"{e}: the change may still be applied; see t1async status {args.run_dir} before "
                           "trying again") from None
    for key, value in reply.get("applied", {}).items():
        print(f"t1async: {key}={json.dumps(value)}")
    return 0

