"""The control socket survives any client: every malformed message gets a one-line error reply
(or, past ZeroMQ's size limit, a dropped connection) and the next ``status`` is answered."""

from __future__ import annotations

import json
import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from t1async.service.control import (
    MAX_FRAME_BYTES,
    MAX_REQUEST_BYTES,
    ControlError,
    ControlServer,
    parse_request,
    request,
)
from t1async.service.rundir import RunDirLock


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A control server (status answers step 3) holding a run directory."""
    run_dir = tmp_path_factory.mktemp("run")
    server = ControlServer("127.0.0.1", {"status": lambda req: {"ok": True, "step": 3},
                                         "stop": lambda req: {"ok": True, "now": req.get("now")}})
    lock = RunDirLock(run_dir)
    lock.write(control=server.address)
    yield run_dir, server
    server.close()
    lock.release()


def _socket(kind: int, address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _reply(sock: zmq.Socket, timeout_s: float = 3.0) -> list[bytes] | None:
    return sock.recv_multipart() if sock.poll(int(timeout_s * 1000)) else None


def test_a_two_part_message_gets_an_error_and_the_socket_keeps_serving(served):
    run_dir, server = served
    sock = _socket(zmq.REQ, server.address)
    try:
        sock.send_multipart([b'{"cmd": "status"}', b"second part"])
        reply = _reply(sock)
        assert reply is not None, "no reply to a two-part request"
        assert json.loads(reply[-1]) == {"ok": False, "error": "a control request is one JSON frame, this message has 2"}
    finally:
        sock.close()
    assert request(run_dir, {"cmd": "status"}, timeout_s=3)["step"] == 3


@pytest.mark.parametrize("frames, error", [
    ([b"\xff\xfe"], "UTF-8 JSON"),
    ([b"not json"], "UTF-8 JSON"),
    ([b"[1, 2]"], 'JSON object with a "cmd" string'),
    ([b'{"cmd": 7}'], 'JSON object with a "cmd" string'),
    ([b'{"cmd": "dance"}'], "unknown command 'dance'; commands: status, stop"),
    ([b" " * (MAX_REQUEST_BYTES + 1)], f"at most {MAX_REQUEST_BYTES} bytes"),
    ([], "has 0"),
])
def test_each_malformed_request_is_named_in_one_line(served, frames, error):
    run_dir, server = served
    sock = _socket(zmq.DEALER, server.address)  # (no REQ state machine: any frames, an empty message too)
    try:
        sock.send_multipart([b"", *frames])
        reply = _reply(sock)
        assert reply is not None and reply[0] == b""
        body = json.loads(reply[1])
        assert body["ok"] is False and error in body["error"] and "\n" not in body["error"]
    finally:
        sock.close()
    assert request(run_dir, {"cmd": "status"}, timeout_s=3)["step"] == 3


def test_a_message_past_the_frame_limit_drops_that_client_only(served):
    run_dir, server = served
    sock = _socket(zmq.DEALER, server.address)
    try:
        sock.send_multipart([b"", b"x" * (MAX_FRAME_BYTES + 1)])
        assert _reply(sock, timeout_s=0.5) is None  # ZeroMQ disconnected it: nothing can answer
    finally:
        sock.close()
    assert request(run_dir, {"cmd": "stop", "now": True}, timeout_s=3) == {"ok": True, "now": True}


def test_parse_request_accepts_a_request_and_refuses_the_rest():
    assert parse_request([b'{"cmd": "scale", "changes": {"learner.lr": 0.1}}'])["changes"] == {"learner.lr": 0.1}
    with pytest.raises(ControlError, match="one JSON frame"):
        parse_request([b"{}", b"{}"])


_frame = st.one_of(st.binary(max_size=64), st.just(b""), st.just(b'{"cmd": "status"}'),
                   st.builds(lambda d: json.dumps(d).encode(),
                             st.dictionaries(st.sampled_from(["cmd", "now", "changes", "x"]),
                                             st.one_of(st.none(), st.integers(), st.text(max_size=8),
                                                       st.lists(st.integers(), max_size=3)), max_size=3)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(_frame, max_size=4), dealer=st.booleans())
def test_fuzzed_messages_each_get_one_reply_and_status_still_answers(served, frames, dealer):
    """Any frames from a DEALER (with or without the empty delimiter) or a REQ client: exactly
    one reply, ``ok`` false unless it was a well-formed request, and the socket keeps serving."""
    run_dir, server = served
    sock = _socket(zmq.DEALER if dealer else zmq.REQ, server.address)
    try:
        frames = frames or [b""]  # (ZeroMQ sends no message of zero frames)
        sock.send_multipart(frames)
        reply = _reply(sock)
        assert reply is not None, f"no reply to {frames!r}"
        body = json.loads(reply[-1])
        assert isinstance(body, dict) and isinstance(body.get("ok"), bool)
        if not body["ok"]:
            assert body["error"] and "\n" not in body["error"]
        assert _reply(sock, timeout_s=0.01) is None  # one reply, not two
    finally:
        sock.close()
    assert request(run_dir, {"cmd": "status"}, timeout_s=3)["step"] == 3


def test_a_flood_of_garbage_is_answered_and_logged_with_a_count_not_a_line_each(served):
    from loguru import logger

    run_dir, server = served
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING", format="{message}")
    before = server.refused
    sock = _socket(zmq.REQ, server.address)
    try:
        for i in range(250):
            sock.send(b"garbage %d" % i)
            assert json.loads(_reply(sock)[-1])["ok"] is False
    finally:
        sock.close()
        logger.remove(sink)
    assert server.refused - before == 250
    refused = [x for x in lines if x.startswith("control request refused")]
    assert 2 <= len(refused) <= 10 + 3, refused  # the first ten of the server's life, then every 100th
    assert refused[-1].startswith(f"control request refused ({server.refused // 100 * 100} so far)")
    assert request(run_dir, {"cmd": "status"}, timeout_s=3)["step"] == 3


def test_status_shows_rejected_trajectories_by_reason():
    from t1async.service.control import format_status

    text = format_status({"run_dir": "/r", "state": "running", "step": 4, "version": 2, "rejected": 3,
                          "rejected_by": {"token_ids": 2, "<frame>": 1}})
    [line] = [x for x in text.splitlines() if x.startswith("rejected")]
    assert line.split(None, 2)[2].strip() == '3 {"token_ids": 2, "<frame>": 1}'


def test_status_shows_the_last_steps_by_agent():
    """``t1async status``: the last 10 metrics rows' ``by_agent`` merged, one table row per agent (and in --json)."""
    from t1async.service.control import format_status
    from t1async.service.service import trends

    split = {"builtin": {"trajectories": 3, "reward_mean": 1.0, "resolved_rate": 0.25, "turns_mean": 2.0, "tokens": 90,
                         "history_breaks": 0, "template_mismatches": 0},
             "mini-swe-agent": {"trajectories": 1, "reward_mean": 3.0, "resolved_rate": 1.0, "turns_mean": 4.0,
                                "tokens": 700, "history_breaks": 1, "template_mismatches": 2}}
    rows = [{"step": s, "version": s, "trajectories": 4, "reward_mean": 1.5, "resolved_rate": 0.4, "staleness_max": 0,
             "time": time.time() - 20 + s, **({"by_agent": split} if s > 1 else {})} for s in range(1, 13)]
    status = trends(rows)  # the last 10 rows: 10 with by_agent
    assert status["by_agent"]["mini-swe-agent"]["trajectories"] == 10 and status["by_agent"]["builtin"]["tokens"] == 900
    assert json.loads(json.dumps(status))["by_agent"] == status["by_agent"]
    text = format_status({"run_dir": "/r", "state": "running", "step": 12, "version": 12, **status})
    cells = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]] for ln in text.splitlines()
             if ln.startswith("│") and ln.split("│")[1].strip() in split}
    assert cells == {"builtin": ["30", "1.00", "0.25", "2.0", "900", "0", "0"],
                     "mini-swe-agent": ["10", "3.00", "1.00", "4.0", "7000", "10", "20"]}
    assert "by agent" not in format_status({"run_dir": "/r", "state": "running", "step": 0, "version": 0,
                                            **trends([])})


def test_status_shows_every_drop_counter_the_restart_ones_included_and_the_memory_monitors_kills():
    """Issue 42 (a fresh user): ``dropped_stale_restart`` was only in summary.json; the table showed
    only the non-zero reasons of ``dropped``, none of them the restart's."""
    from t1async.service.control import format_status

    text = format_status({"run_dir": "/r", "state": "running", "step": 9, "version": 4,
                          "dropped": {"stale": 5, "verifier_error": 0, "context_full": 2}, "dropped_stale": 5,
                          "dropped_stale_restart": 3, "memory": {"line": "1 role(s) killed by Ray's memory monitor ..."}})
    [line] = [x for x in text.splitlines() if x.startswith("dropped")]
    assert line.split(None, 1)[1].strip() == '7 {"stale": 5, "stale_restart": 3, "context_full": 2}'
    [line] = [x for x in text.splitlines() if x.startswith("memory")]
    assert line.split(None, 1)[1].strip() == "1 role(s) killed by Ray's memory monitor ..."
    quiet = format_status({"run_dir": "/r", "state": "running", "step": 1, "version": 0, "dropped": {}})
    assert '0 {"stale": 0, "stale_restart": 0}' in quiet  # shown when nothing was dropped, too


# ---- what scale says ------------------------------------------------------------------------
def test_scale_of_an_unknown_key_says_it_is_not_a_config_key():
    from t1async.service.control import parse_changes

    with pytest.raises(ControlError) as err:
        parse_changes(["foo.bar=1"])
    assert str(err.value).startswith("foo.bar is not a config key; valid keys of the top level: run, ray, model")
    assert "on a resume" not in str(err.value)
    with pytest.raises(ControlError, match=r"^learner.lrr is not a config key; valid keys of learner: max_steps"):
        parse_changes(["learner.lrr=0.1"])


def test_scale_with_a_value_of_the_wrong_type_names_the_key(tmp_path):
    from t1async.config import load_config
    from t1async.service.service import Service

    cfg = load_config(None, ["run.tensorboard=false"])
    service = Service(cfg, tmp_path, {}, restart_learner=lambda: None, check_tasks=lambda names: None)
    with pytest.raises(ValueError) as err:
        service.scale({"changes": {"learner.lr": "abc"}})
    assert str(err.value).startswith('scale: bad value of learner.lr="abc": ') and "\n" not in str(err.value)



def test_scale_refuses_a_value_its_section_rule_refuses_in_the_config_s_one_line(tmp_path):
    """A live change is checked by the same rules as a config file: the section's own (beside the
    field) and the cross-section ones, named with the source ``scale``."""
    from t1async.config import load_config
    from t1async.service.service import Service

    cfg = load_config(None, ["run.tensorboard=false"])
    service = Service(cfg, tmp_path, {}, restart_learner=lambda: None, check_tasks=lambda names: None)
    with pytest.raises(ValueError, match=r"^scale: learner.lr=0.0 is invalid: use a positive float$"):
        service.scale({"changes": {"learner.lr": 0}})
    with pytest.raises(ValueError, match=r"^scale: rollout.num_actors=0 is invalid: use an integer >= 1"):
        service.scale({"changes": {"rollout.num_actors": 0}})
    assert service.cfg is cfg  # nothing applied


def test_restart_counts_hold_the_samplers_too(tmp_path):
    """What summary.json's ``restarts`` is made of (t1async/service/launch.py): the learner's, the controller's and
    the embedded samplers' restarts."""
    from types import SimpleNamespace

    from t1async.config import load_config
    from t1async.service.service import Service

    cfg = load_config(None, ["run.tensorboard=false"])
    service = Service(cfg, tmp_path, {}, restart_learner=lambda: None, check_tasks=lambda names: None,
                      samplers=SimpleNamespace(restarts=3))  # (the pool's counter)
    service.restarts["learner"] = 1
    assert service.restart_counts() == {"learner": 1, "controller": 0, "samplers": 3}


def test_the_live_line_fits_an_80_column_terminal():
    from t1async.service.service import fit_line

    fields = ["step 12345", "v6172", "actors 16", "samplers 4/4", "traj/s 12.34", "reward 3.25", "resolved 0.42",
              "staleness 2", "queue 17", "restarts 3"]
    full = "  ".join(fields)
    assert len(full) > 79 and fit_line(fields, 200) == full
    line = fit_line(fields, 79)
    assert len(line) <= 79 and line.startswith("step 12345  v6172  ") and "reward 3.25" in line and "resolved 0.42" in line
    assert "restarts" not in line  # the least important go first, the order of the rest is kept
    assert fit_line(fields, 40) == "step 12345  v6172  reward 3.25"
    assert fit_line(fields, 5) == "step "


@pytest.mark.parametrize("changes", [["rollout.num_actors", 4], "rollout.num_actors=4", 4, None, {}])
def test_scale_with_changes_that_are_not_an_object_is_one_line(tmp_path, changes):
    """Issue 42 item 9: ``{"cmd": "scale", "changes": [...]}`` answered Python's own error
    (``dictionary update sequence element #0 ...``)."""
    from t1async.config import load_config
    from t1async.service.service import Service

    cfg = load_config(None, ["run.tensorboard=false"])
    service = Service(cfg, tmp_path, {}, restart_learner=lambda: None, check_tasks=lambda names: None)
    server = ControlServer("127.0.0.1", service.handlers())
    try:
        reply = server.answer([json.dumps({"cmd": "scale", "changes": changes}).encode()])
    finally:
        server.close()
    assert reply["ok"] is False and "\n" not in reply["error"]
    assert reply["error"].startswith('scale: "changes" must be a non-empty JSON object of key: value'), reply
    assert service.cfg is cfg


def test_status_json_keeps_the_controllers_actors_detail(tmp_path, monkeypatch):
    """Issue 42 item 9: ``status --json`` showed no ``controller.actors_detail`` while running
    (the service moved it to ``actors``)."""
    from types import SimpleNamespace

    from t1async.config import load_config
    from t1async.service import service as service_mod

    detail = [{"id": 0, "state": "running", "version": 3, "episodes": 2, "started_at": 1.0, "first_episode_at": 2.0}]
    controller = SimpleNamespace(status=SimpleNamespace(remote=lambda: {"actors_detail": detail, "actors": 1,
                                                                         "episode_failures": {}}))
    learner = SimpleNamespace(status=SimpleNamespace(remote=lambda: {}))
    monkeypatch.setattr(service_mod.ray, "get", lambda ref, timeout=None: ref)  # (no Ray: the handles answer at once)
    cfg = load_config(None, ["run.tensorboard=false"])
    service = service_mod.Service(cfg, tmp_path, {"learner": learner, "controller": controller, "samplers": []},
                                  restart_learner=lambda: None, check_tasks=lambda names: None)
    st = json.loads(json.dumps(service.status(), default=str))
    assert st["controller"]["actors_detail"] == detail and st["actors"] == detail


def test_a_scale_the_service_is_slow_to_apply_is_waited_for_or_said_to_be_maybe_applied(tmp_path, monkeypatch, capsys):
    """A fresh operator's ``scale --force`` to 18 actors at load 51: the command said "did not
    answer within 15 s" (exit 2) and the change was applied 16 s later. ``scale`` now waits
    :data:`SCALE_TIMEOUT_S`, and past it says the change may still be applied and where to look."""
    from t1async import cli
    from t1async.service import control

    def slow_scale(req):
        time.sleep(1.0)  # (the controller starting actors on a loaded node)
        return {"ok": True, "applied": req["changes"]}

    server = ControlServer("127.0.0.1", {"scale": slow_scale})
    lock = RunDirLock(tmp_path)
    lock.write(control=server.address)
    try:
        monkeypatch.setattr(control, "SCALE_TIMEOUT_S", 0.3)
        assert cli.main(["scale", str(tmp_path), "rollout.num_actors=3"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "did not answer within" in err
        assert err.endswith(f"the change may still be applied; see t1async status {tmp_path} before trying again")
        time.sleep(1.5)  # (the server finishes the first request)
        monkeypatch.setattr(control, "SCALE_TIMEOUT_S", 10.0)
        assert cli.main(["scale", str(tmp_path), "rollout.num_actors=3"]) == 0
        assert capsys.readouterr().out.strip() == "t1async: rollout.num_actors=3"
    finally:
        server.close()
        lock.release()
