"""Named harnesses in a ``container`` sandbox: each borrows its host install (read-only binds) and reaches the
rollout actor's endpoint through the one port served on the container's own loopback, with the task's network
(``--network=none`` here) otherwise unchanged.

Real: podman (runc), the shipped task's image (its Debian stand-in), Codex CLI, Claude Code, mini-swe-agent,
the Terminus-style program and the host's tmux, the endpoint and its recorder, the rollout actor, the task's
verifier, network namespaces. Faked: the policy (tests/support/oracle_policy.py: the task's oracle commands as
the harness's own tool calls or keystrokes; the tiny models on CPU emit noise).
"""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from t1async.actors.rollout import RolloutActor
from t1async.config import EnvConfig, GenerationConfig, ModelConfig, RolloutConfig, TransportConfig
from t1async.envs.sandboxes.loopback_relay import LoopbackRelay
from t1async.envs.terminal import TerminalEnv
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout import harnesses, mini_swe_agent
from t1async.trajectory import decode, encode
from tests.support.container_support import base_image
from tests.support.oracle_policy import E, OraclePolicy, TerminusPolicy, oracle_commands

REPO = Path(__file__).resolve().parents[3]
TOK = ChatTokenizer.load()
MODEL = ModelConfig(vocab_size=4100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                    max_position_embeddings=65536)  # (Codex's and Claude Code's prompts: ~10k and ~27k tokens)
TASK = "make-project-skeleton"  # allow_internet = false: the container runs with --network=none
ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def image():
    """The base image stand-ins, bootstrapped once per machine (podman's storage keeps them); the task's
    image is then built once by the first episode and found by its content hash by the others."""
    return base_image()


@pytest.mark.container
@pytest.mark.skipif(not ROOT, reason="serving the endpoint inside a container's network namespace needs root")
@pytest.mark.parametrize("name", ["codex", "claude-code", "mini-swe-agent", "terminus"])
def test_a_named_harness_resolves_a_shipped_task_inside_a_container(tmp_path, monkeypatch, image, name):
    """rollout.agent=<name>, env.sandbox=container: the harness runs inside the task's container (its install
    borrowed read-only, the endpoint's port relayed into the container's loopback), runs the task's oracle
    commands through its own tool (terminus: as keystrokes into tmux, the host's tmux: the image has none),
    and the task's verifier resolves it; the trajectory is exact (drift 0) and records its agent. The
    container's network stayed the task's (only ``lo``)."""
    h = harnesses.HARNESSES[name]
    if shutil.which(h.binary) is None:
        pytest.skip(f"{h.binary} is not installed: {h.install}")
    commands = oracle_commands(REPO / "t1async" / "envs" / "tasks" / TASK)
    env_cfg = EnvConfig(max_turns=10, tasks=[TASK], sandbox="container", episode_timeout_s=600)  # (litellm's import)
    actor = RolloutActor(0, env_cfg, GenerationConfig(max_new_tokens=256), MODEL, TransportConfig(curve=False),
                         ["http://127.0.0.1:9"], "tcp://127.0.0.1:9", rollout_cfg=RolloutConfig(agent=name),
                         work_root=str(tmp_path / "work"))
    seen: dict[str, str] = {}
    verify = TerminalEnv.verify

    def look_then_verify(env):  # the container as the harness left it, before the verifier
        seen["net"] = env.sandbox.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").output.split()
        seen["tmux"] = env.sandbox.exec("command -v tmux; ls /tmp/t1async-harness/bin 2>/dev/null").output.split()
        return verify(env)

    monkeypatch.setattr(TerminalEnv, "verify", look_then_verify)
    if name == "terminus":
        policy = actor.sampler = TerminusPolicy(TOK, commands)
    else:
        final_call = mini_swe_agent.SUBMIT if name == "mini-swe-agent" else None
        policy = actor.sampler = OraclePolicy(TOK, commands, tool=h.tool[0], argument=h.tool[1], final_call=final_call)
    try:
        [traj] = actor.run_one(TASK)
    finally:
        actor.endpoint.shutdown()
        actor.sender.close()
    log = (actor.workdir / "agent-logs" / "agent-0.log").read_text(errors="replace")
    traj = decode(encode(traj), num_experts=E, num_layers=2, top_k=2)
    assert traj.resolved and traj.passed == traj.total >= 1, log[-3000:]
    assert traj.finish_reason == ("end_signal" if name == "terminus" else "agent_exit")
    assert traj.drift_tokens == 0 and traj.agent == name
    assert len(traj.turn_offsets) == len(commands) + (2 if name == "terminus" else 1)
    assert traj.token_ids.tolist() == policy.calls[-1] + policy.outputs[-1]
    assert seen["net"] == ["lo"]  # --network=none kept: the endpoint came through the relay
    if name == "terminus":  # the image has no tmux: the wrapper of the host's ran it
        assert seen["tmux"] == ["tmux"]


# ---------------------------------------------------------------- the relay, without an engine

class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = b"hello from the host " + self.path.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


FETCH = ("import sys, urllib.request\n"
         "try:\n"
         "    print(urllib.request.urlopen(sys.argv[1], timeout=20).read().decode())\n"
         "except OSError as e:\n"
         "    print('refused', type(e).__name__)\n")


@pytest.mark.skipif(not ROOT or not all(map(shutil.which, ("unshare", "nsenter", "ip"))),
                    reason="needs root, unshare and nsenter (util-linux) and ip (iproute2)")
def test_the_relay_serves_one_host_port_inside_a_namespace_without_network(tmp_path):
    """A network namespace with only its loopback (``unshare -n``, as ``--network=none``): through the relay, a
    client inside reaches the host's server at the same 127.0.0.1 URL; another host port stays unreachable from
    inside; after close, the port is gone there too."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    for s in (server, other):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    port, other_port = server.server_address[1], other.server_address[1]
    holder = subprocess.Popen(["unshare", "-n", "sh", "-c", "ip link set lo up && echo ready && exec sleep 300"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        netns = f"/proc/{holder.pid}/ns/net"
        assert os.readlink(netns) != os.readlink("/proc/self/ns/net")

        def fetch(p: int) -> str:
            done = subprocess.run(["nsenter", f"--net={netns}", "python3", "-c", FETCH, f"http://127.0.0.1:{p}/x"],
                                  capture_output=True, text=True, timeout=180)
            return done.stdout.strip()

        assert fetch(port).startswith("refused")  # nothing there before the relay
        relay = LoopbackRelay(netns, [port])
        relay.start()
        try:
            assert fetch(port) == "hello from the host /x" and relay.connections == 1
            assert fetch(other_port).startswith("refused")  # only the relayed port
        finally:
            relay.close()
        assert fetch(port).startswith("refused")
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # the host's own server is untouched
    finally:
        holder.kill()
        holder.wait()
        server.shutdown()
        other.shutdown()


# ---------------------------------------------------------------- bad input

def test_a_harness_that_cannot_reach_a_container_or_modal_is_refused_in_one_line(monkeypatch):
    """At rollout-actor start: in a container without root (the endpoint cannot be served in the container's
    namespace), and in Modal (neither the install nor the endpoint reaches it), one line naming the cause and
    what to do; in local (bubblewrap) nothing is asked."""
    name = next((n for n, h in harnesses.HARNESSES.items() if shutil.which(h.binary)), None)
    if name is None:
        pytest.skip("no harness is installed")
    with pytest.raises(ValueError, match=rf"^rollout.agent={name} cannot run in env.sandbox=modal: .*use "
                                         r"env.sandbox=container or local$"):
        harnesses.check_sandbox(name, "modal")
    harnesses.check_sandbox(name, "local")
    monkeypatch.setattr(harnesses.os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match=rf"^rollout.agent={name} in env.sandbox=container: entering the container's "
                                         r"network namespace .* needs root .*env.sandbox=local"):
        harnesses.check_sandbox(name, "container")
    with pytest.raises(ValueError, match="needs root"):
        RolloutActor(0, EnvConfig(tasks=[TASK], sandbox="container"), GenerationConfig(), MODEL,
                     TransportConfig(curve=False), ["http://127.0.0.1:9"], "tcp://127.0.0.1:9",
                     rollout_cfg=RolloutConfig(agent=name))


def test_mini_swe_agent_on_the_system_python_is_refused_for_containers(monkeypatch, tmp_path):
    """A mini-swe-agent venv made from /usr's Python cannot be lent (binding it would hide the image's /usr):
    one line naming the venv, the Python and the install command."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python3").symlink_to("/usr/bin/python3")  # (resolved without being run)
    (venv / "bin" / "mini").write_text("#!/bin/sh\n")
    (venv / "bin" / "mini").chmod(0o755)
    monkeypatch.setattr(mini_swe_agent, "VENV", str(venv))
    monkeypatch.setitem(harnesses.HARNESSES, "mini-swe-agent", harnesses.Harness(
        **{**harnesses.HARNESSES["mini-swe-agent"].__dict__, "binary": str(venv / "bin" / "mini")}))
    harnesses.container_plan.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"^rollout.agent=mini-swe-agent in a container: its venv .* the system "
                                             r"Python, .*install mini-swe-agent"):
            harnesses.container_plan("mini-swe-agent")
    finally:
        harnesses.container_plan.cache_clear()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_terminus_in_an_image_without_python3_says_what_to_add_in_one_line(tmp_path):
    """The terminus prelude in a container whose image has no python3 (here: a bash whose PATH has none) prints
    one line naming the Dockerfile line to add and exits 127 before the harness starts."""
    plan = harnesses.container_plan("terminus")
    line = harnesses.in_container(plan, "echo the-harness-ran")
    done = subprocess.run(["/bin/bash", "-c", line], env={"PATH": str(tmp_path)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 127 and done.stdout.splitlines() == [harnesses.NO_PYTHON]
    assert "apt-get install -y python3" in harnesses.NO_PYTHON
