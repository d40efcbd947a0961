"""The Sandbox contract, run against every backend.

* ``local``: bubblewrap on this host, always.
* ``modal-fake``: the real :class:`ModalSandbox` code against a fake of Modal's cloud
  (tests/support/modal_fake.py: a local bubblewrap container entered with nsenter); needs root.
* ``container``: podman containers from the bootstrapped ``python:3.13-slim`` stand-in
  (tests/support/container_support.py; skipped without podman).
* ``modal``: the real Modal cloud, only where credentials exist (skipped otherwise, with the reason).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import pytest

from t1async.envs.protocol import Sandbox, SandboxError, SandboxSpec
from t1async.envs.sandboxes.container import ContainerSandbox
from t1async.envs.sandboxes.local import LocalSandbox
from t1async.envs.sandboxes.modal_sandbox import ModalSandbox, has_modal_credentials
from tests.support.container_support import base_image
from tests.support.modal_fake import FakeModal

BACKENDS = ["local", pytest.param("container", marks=pytest.mark.container), "modal-fake", "modal"]


def make(backend: str, tmp_path: Path, **kw) -> Sandbox:
    spec = SandboxSpec(episode_dir=tmp_path, command_timeout_s=kw.pop("command_timeout_s", 5.0),
                       max_output_bytes=kw.pop("max_output_bytes", 2048), docker_image="debian:bookworm-slim")
    if backend == "local":
        return LocalSandbox.from_spec(spec)
    if backend == "container":
        spec.docker_image = base_image()
        return ContainerSandbox.from_spec(spec)
    if backend == "modal-fake":
        if os.geteuid() != 0 or shutil.which("nsenter") is None:
            pytest.skip("the fake Modal cloud needs root and nsenter")
        return ModalSandbox(spec, modal_module=FakeModal)
    if not has_modal_credentials():
        pytest.skip("no Modal credentials (MODAL_TOKEN_ID/MODAL_TOKEN_SECRET or ~/.modal.toml): the real cloud is not tried")
    return ModalSandbox(spec)


@pytest.fixture(params=BACKENDS)
def box(request, tmp_path):
    sandbox = make(request.param, tmp_path)
    sandbox.start()
    yield sandbox
    sandbox.close()


def test_is_a_sandbox(box):
    assert isinstance(box, Sandbox)
    assert isinstance(type(box).builds_image, bool)


def test_persistent_shell(box):
    assert box.exec("pwd").output == "/app\n"
    assert box.exec("cd /tmp && export ANSWER=42").exit_code == 0
    result = box.exec('pwd; echo "$ANSWER"; echo err >&2; false')
    assert result.output == "/tmp\n42\nerr\n" and result.exit_code == 1 and not result.timed_out


def test_quoting_and_stdin(box):
    assert box.exec("cat; echo read=$?").output == "read=0\n"
    assert box.exec("echo 'unclosed").exit_code == 2
    assert box.exec("cat <<'EOF'\n$HOME it's\nEOF").output == "$HOME it's\n"


def test_timeout_kills_the_process_tree(box):
    marks = [str(random.randrange(10**6, 10**7) + i) for i in range(3)]
    started = time.monotonic()
    result = box.exec(f"setsid sleep {marks[0]} & (setsid sh -c 'sleep {marks[1]} &' &); sleep {marks[2]}", timeout_s=1.0)
    assert result.timed_out and result.exit_code == 124 and "timed out after 1 s" in result.output
    assert time.monotonic() - started < 8
    pattern = f"^sleep [{''.join(sorted(set(''.join(marks))))}]*$"
    for _ in range(40):  # SIGKILLed processes may take a moment to finish exiting on a loaded machine
        left = box.exec(f"ps -eo stat=,args= | grep -v '^Z' | sed 's/^[^ ]* *//' | grep -c '{pattern}' || true")
        if left.output.split()[-1] == "0":  # (after bash's "Killed" job notice, if any)
            break
        time.sleep(0.05)
    assert left.output.split()[-1] == "0", left.output + box.exec("ps -eo pid,ppid,stat,args").output
    assert box.exec("echo still here").output.endswith("still here\n")


@pytest.mark.slow
def test_stuck_shell_is_replaced(box):
    result = box.exec("while :; do :; done", timeout_s=0.5)
    assert result.timed_out and "new shell was started" in result.output
    assert box.exec("pwd").output == "/app\n"


def test_exit_restarts_the_shell(box):
    result = box.exec("exit 7")
    assert result.exit_code == 7 and "the shell exited (status 7)" in result.output
    assert box.exec("echo alive").output == "alive\n"


def test_output_is_truncated_with_a_marker(tmp_path):
    for backend in ("local", "modal-fake", "container"):
        try:
            sandbox = make(backend, tmp_path / backend, max_output_bytes=128)
        except pytest.skip.Exception:
            continue
        sandbox.start()
        try:
            result = sandbox.exec("seq 1 20000")
        finally:
            sandbox.close()
        assert result.truncated and result.output.startswith("1\n2\n") and result.output.endswith("19999\n20000\n")
        assert "[... truncated" in result.output


def test_put_clear_read(box, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("a\n")
    (src / "sub" / "b.txt").write_text("b\n")
    box.put([src], "/app/data/")
    box.put([src / "a.txt"], "/app/renamed.txt")
    box.put([src / "a.txt"], "/tests/")
    assert box.exec("cat data/a.txt data/sub/b.txt renamed.txt /tests/a.txt").output == "a\nb\na\na\n"
    assert box.exec("echo more >> data/a.txt").exit_code == 0  # the copies belong to the shell's user
    assert box.read("/app/data/a.txt", 1024) == b"a\nmore\n"
    assert box.read("/app/data/a.txt", 5) == b"more\n"
    assert box.read("/app/missing.txt", 100) == b""
    box.exec("ln -s /etc/passwd /app/link.txt")
    assert box.read("/app/link.txt", 100) == b""  # a symlink is never followed
    box.exec("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")
    box.clear("/logs/verifier")
    assert box.exec("ls -A /logs/verifier").output == ""
    box.clear("/tests")
    assert box.exec("ls -A /tests").output == ""


def test_paths_outside_the_roots_are_refused(box, tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SandboxError, match="not under"):
        box.put([tmp_path / "f"], "/etc/x")
    with pytest.raises(SandboxError, match="not under"):
        box.read("/app/../etc/passwd", 10)


def test_close_is_idempotent_and_final(tmp_path):
    sandbox = make("local", tmp_path)
    sandbox.start()
    sandbox.close()
    sandbox.close()
    with pytest.raises(SandboxError):
        sandbox.exec("true")
