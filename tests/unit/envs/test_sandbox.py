"""The local bubblewrap sandbox, run for real: persistence, timeouts, isolation, cleanup."""

from __future__ import annotations

import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import pytest

from t1async.envs.sandboxes import hostfs
from t1async.envs.sandboxes import sandbox as sandbox_module
from t1async.envs.sandboxes.sandbox import (
    SANDBOXES,
    LocalSandbox,
    Sandbox,
    SandboxError,
    SandboxUnavailable,
    bash_quote,
    check_sandbox_available,
)
from tests.support import REPO
from tests.support.sandboxes import python_skeleton


def make_sandbox(tmp_path: Path, **kwargs) -> LocalSandbox:
    return LocalSandbox(tmp_path / "app", tests_dir=tmp_path / "tests", logs_dir=tmp_path / "logs", **kwargs)


@pytest.fixture
def sb(tmp_path):
    box = make_sandbox(tmp_path, command_timeout_s=5.0)
    box.start()
    yield box
    box.close()


def host_pids_with_cmdline(fragment: str) -> list[int]:
    """Host processes whose command line contains ``fragment``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if fragment in cmdline and state != "Z":
            found.append(int(entry))
    return found


def test_registry_and_protocol(tmp_path):
    assert SANDBOXES["local"] is LocalSandbox and "modal" in SANDBOXES
    assert isinstance(make_sandbox(tmp_path), Sandbox)


def test_exec_before_start_raises(tmp_path):
    with pytest.raises(SandboxError, match="start"):
        make_sandbox(tmp_path).exec("true")


def test_cwd_and_exported_env_persist(sb):
    assert sb.exec("pwd").output == "/app\n"
    assert sb.exec("mkdir -p /tmp/work && cd /tmp/work && export ANSWER=42 && PLAIN=7").exit_code == 0
    result = sb.exec('pwd; echo "$ANSWER $PLAIN"; sh -c \'echo "child sees ${ANSWER:-nothing}"\'')
    assert result.output == "/tmp/work\n42 7\nchild sees 42\n"


def test_exit_status_and_merged_stderr(sb):
    result = sb.exec("echo out; echo err >&2; exit_code_is() { return 3; }; exit_code_is")
    assert result.exit_code == 3
    assert result.output == "out\nerr\n"
    assert not result.timed_out and not result.truncated
    assert sb.exec("printf abc").output == "abc"  # no newline added or lost


def test_stdin_is_dev_null_and_bad_syntax_does_not_desync(sb):
    assert sb.exec("cat; read line; echo read=$?").output == "read=1\n"
    bad = sb.exec("echo 'unclosed")
    assert bad.exit_code == 2 and "unexpected EOF" in bad.output
    assert sb.exec("echo still-fine").output == "still-fine\n"
    assert sb.exec("cat <<'EOF'\nline one\n$NOT_EXPANDED\nEOF").output == "line one\n$NOT_EXPANDED\n"


def test_bash_quote_round_trips(sb):
    for text in ["plain", "it's \\ \"quoted\"", "multi\nline\ttab", "$(rm -rf /) `x` $HOME", "héllo 日本 \x01"]:
        assert sb.exec(f"printf '%s' {bash_quote(text)}").output == text
    assert "\n" not in bash_quote("a\nb")


def unique_seconds() -> list[str]:
    """Sleep durations no concurrent test run will use, to find our own processes on the host."""
    base = random.randrange(10**6, 10**7)
    return [str(base + i) for i in range(3)]


def test_timeout_kills_setsid_and_double_forked_children_and_shell_survives(sb):
    sb.exec("cd /tmp && export KEEP=yes")
    a, b, c = unique_seconds()
    started = time.monotonic()
    result = sb.exec(f"setsid sleep {a} & (setsid sh -c 'sleep {b} &' &); sleep {c}", timeout_s=1.0)
    assert result.timed_out and result.exit_code == 124
    assert "timed out after 1 s" in result.output
    assert time.monotonic() - started < 4.0
    for marker in (f"sleep {a}", f"sleep {b}", f"sleep {c}"):
        assert host_pids_with_cmdline(marker) == [], f"{marker} survived the timeout"
    after = sb.exec("pwd; echo $KEEP")  # may start with bash's "Killed" notice of a background job
    assert after.output.endswith("/tmp\nyes\n") and after.exit_code == 0 and not after.timed_out


def test_timeout_in_builtin_loop_restarts_shell_in_app(sb):
    sb.exec("cd /tmp")
    result = sb.exec("while :; do :; done", timeout_s=0.5)
    assert result.timed_out and result.exit_code == 124
    assert "new shell was started in /app" in result.output
    assert sb.restarts == 1
    assert sb.exec("pwd").output == "/app\n"


def test_exit_and_kill_of_the_shell_restart_it(sb):
    sb.exec("cd /tmp && export GONE=1")
    result = sb.exec("exit 7")
    assert result.exit_code == 7 and "the shell exited (status 7)" in result.output
    assert sb.exec('pwd; echo "[$GONE]"').output == "/app\n[]\n"
    killed = sb.exec("kill -9 $$", timeout_s=5)
    assert "new shell was started" in killed.output and not killed.timed_out
    assert sb.exec("echo alive").output == "alive\n"
    assert sb.restarts == 2


def test_output_truncation_keeps_head_and_tail(tmp_path):
    box = make_sandbox(tmp_path, max_output_bytes=256)
    box.start()
    try:
        result = box.exec("seq 1 100000")
    finally:
        box.close()
    total = len("".join(f"{i}\n" for i in range(1, 100001)))
    assert result.truncated and result.exit_code == 0
    assert result.output.startswith("1\n2\n3\n")
    assert result.output.endswith("99999\n100000\n")
    assert f"\n[... truncated {total - 256} bytes ...]\n" in result.output


def test_gigantic_output_is_read_with_bounded_memory(sb):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = sb.exec("head -c 300000000 /dev/zero | tr '\\0' x; echo; echo END", timeout_s=30)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert result.exit_code == 0 and result.truncated
    assert result.output.endswith("\nEND\n")
    assert "[... truncated 29999" in result.output
    assert grown_mb < 64, f"reading 300 MB of output grew the process by {grown_mb:.0f} MB"


def test_no_network(sb):
    probe = (
        "python3 -c \"import socket; s = socket.socket(); s.settimeout(2); "
        "s.connect(('1.1.1.1', 53))\""
    )
    result = sb.exec(probe)
    assert result.exit_code != 0 and ("unreachable" in result.output or "Errno" in result.output)
    interfaces = sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").output.split()
    assert interfaces == ["lo"]


def test_host_files_are_invisible(sb):
    host_root = sorted(os.listdir("/root"))
    inside_root = sb.exec("ls -A /root").output.split()
    python_top = [p.parts[2] for p in map(Path, (sys.prefix, sys.base_prefix)) if p.parts[1:2] == ("root",)]
    assert set(inside_root) <= set(python_top), f"/root inside shows {inside_root} (host has {host_root})"
    for path in ("/work", str(REPO / "pyproject.toml"), str(REPO / "t1async" / "envs"), "/etc/shadow", "/etc/gshadow",
                 "/root/.ssh", os.path.expanduser("~/.bash_history"), "/etc/pip.conf", "/etc/gitconfig"):
        if Path(path).is_relative_to(sys.prefix) or Path(path).is_relative_to(sys.base_prefix):
            continue
        skeleton = python_skeleton(path)
        if skeleton is not None:  # an ancestor of the interpreter's folders: only the way down to them shows
            inside = sb.exec(f"ls -A {path}").output.split()
            assert set(inside) <= skeleton, f"{path} inside shows {inside}, not only the way to the interpreter"
            continue
        assert sb.exec(f"test -e {path}").exit_code == 1, f"{path} is visible inside the sandbox"
    assert sb.exec("test -f /etc/passwd && test -f /etc/hosts").exit_code == 0


def test_system_is_read_only_and_capabilities_dropped(sb):
    probe = f"/usr/t1async-probe-{os.getpid()}"
    try:
        assert sb.exec(f"touch {probe}").exit_code != 0
        assert not Path(probe).exists()
    finally:
        Path(probe).unlink(missing_ok=True)
    assert sb.exec("touch /etc/passwd").exit_code != 0
    assert sb.exec("touch /tests/x").exit_code != 0
    mount = sb.exec("mount -t tmpfs none /tmp")
    assert mount.exit_code != 0, mount.output
    assert sb.exec("grep CapEff /proc/self/status").output.split()[1] == "0000000000000000"


def test_workspace_tests_and_logs_binds(sb, tmp_path):
    sb.exec("echo from-inside > /app/made.txt && mkdir -p /logs/verifier && echo 3 > /logs/verifier/reward.txt")
    assert (tmp_path / "app" / "made.txt").read_text() == "from-inside\n"
    assert (tmp_path / "logs" / "verifier" / "reward.txt").read_text() == "3\n"
    (tmp_path / "tests" / "late.txt").write_text("staged after start\n")
    assert sb.exec("cat /tests/late.txt").output == "staged after start\n"


def test_host_python_and_pytest_work_inside(sb):
    result = sb.exec("command -v python3 && python3 -c 'import pytest, sys; print(sys.version_info[:2])'")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == f"{sandbox_module.SANDBOX_BIN}/python3"
    assert result.output.splitlines()[1] == str(tuple(sys.version_info[:2]))


def test_close_leaves_no_process_on_the_host(tmp_path):
    box = make_sandbox(tmp_path)
    box.start()
    a, b, c = unique_seconds()
    box.exec(f"setsid sleep {a} & (setsid sh -c 'sleep {b} &' &); nohup sleep {c} >/dev/null 2>&1 &")
    time.sleep(0.2)
    assert all(len(host_pids_with_cmdline(f"sleep {s}")) == 1 for s in (a, b, c))
    started = time.monotonic()
    box.close()
    assert time.monotonic() - started < 2.0
    for s in (a, b, c):
        assert host_pids_with_cmdline(f"sleep {s}") == [], f"sleep {s} survived close()"
    box.close()  # idempotent
    with pytest.raises(SandboxError):
        box.exec("true")


def test_environment_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("HOST_ONLY_VAR", "secret")
    box = make_sandbox(tmp_path, env={"TASK_VAR": "v 1", "HOME": "/app"})
    box.start()
    try:
        assert box.exec('echo "$TASK_VAR|$HOME|$LANG"').output == "v 1|/app|C.UTF-8\n"
        assert "HOST_ONLY_VAR" not in box.exec("env").output
    finally:
        box.close()


def test_check_sandbox_available(monkeypatch):
    with pytest.raises(SandboxUnavailable, match="unknown sandbox backend"):
        check_sandbox_available("nope")
    check_sandbox_available("local")
    monkeypatch.setattr(sandbox_module, "_available", set())
    monkeypatch.setattr(hostfs, "_LOCAL_AVAILABLE", [])
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        check_sandbox_available("local")


def test_round_trip_latency(sb):
    sb.exec("true")
    times = []
    for _ in range(200):
        started = time.perf_counter()
        assert sb.exec("true").exit_code == 0
        times.append(time.perf_counter() - started)
    median_ms = statistics.median(times) * 1000
    print(f"median round trip of `true`: {median_ms:.3f} ms")
    assert median_ms < 20


def test_allow_network_shares_the_host_interfaces(tmp_path):
    host = sorted(line.split(":")[0].strip() for line in Path("/proc/net/dev").read_text().splitlines()[2:])
    box = make_sandbox(tmp_path, allow_network=True)
    box.start()
    try:
        inside = sorted(box.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").output.split())
        resolv = box.exec("test -e /etc/resolv.conf").exit_code == 0
    finally:
        box.close()
    assert inside == host
    assert resolv == Path("/etc/resolv.conf").exists()


def test_sandbox_python_is_the_interpreter_whose_packages_were_checked(sb):
    """The task adaptation checks packages with importlib.metadata of this very Python; the
    sandbox's python3 must see the same distributions (from a venv too, not its base Python)."""
    import json
    import subprocess

    probe = ("import importlib.metadata as m, json, sys; print(json.dumps([sys.prefix == sys.base_prefix, "
             "sorted({d.metadata['Name'].lower() for d in m.distributions()})]))")
    result = sb.exec(f"python3 -c {probe!r}")
    in_venv_inside, names = json.loads(result.output)
    assert in_venv_inside == (sys.prefix == sys.base_prefix)
    # the host's view from a fresh interpreter: earlier tests in this process may have extended sys.path
    host = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert names == json.loads(host.stdout)[1]


def test_task_folders_outside_app_are_private_writable_tmpfs(tmp_path):
    """Folders a task writes outside /app (its own, e.g. /db, and WRITABLE) are writable, private
    to the sandbox, and never the host's."""
    from t1async.envs.sandboxes.local import WRITABLE

    box = LocalSandbox(tmp_path / "app", tests_dir=tmp_path / "tests", logs_dir=tmp_path / "logs",
                       writable=("/t1async-db-probe",))
    box.start()
    try:
        result = box.exec("mkdir -p /t1async-db-probe/energy && echo 1 > /t1async-db-probe/energy/x && "
                          "echo 2 > /srv/y && cat /t1async-db-probe/energy/x /srv/y")
        assert result.output == "1\n2\n", result.output
        assert box.exec("touch /t1async-elsewhere").exit_code != 0  # the root stays read-only
    finally:
        box.close()
    assert "/srv" in WRITABLE and not Path("/t1async-db-probe").exists() and not Path("/srv/y").exists()
