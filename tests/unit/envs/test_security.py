"""Escape attempts against the local sandbox, run for real, each bounded so that it cannot harm
this shared machine: tight limits (32 processes, 64-128 MiB memory, 8 MiB disk, 1 s CPU) and
short timeouts. Each must be contained, and where a limit refused something the command's result
says so (``CommandResult.refused`` and a ``[refused: ...]`` note)."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from t1async.envs.protocol import SandboxLimits
from t1async.envs.sandboxes.limits import cgroups_usable
from t1async.envs.sandboxes.local import SANDBOX_UID, LocalSandbox
from tests.support.sandboxes import python_skeleton

ROOT = os.geteuid() == 0
CGROUPS = {"pids", "memory"} <= set(cgroups_usable())


def make(tmp_path: Path, **limits) -> LocalSandbox:
    box = LocalSandbox(tmp_path / "app", tests_dir=tmp_path / "tests", logs_dir=tmp_path / "logs",
                       command_timeout_s=10.0, limits=SandboxLimits(**{"max_processes": 32, "memory_mb": 128,
                                                                       "disk_mb": 8, "cpu_time_s": 5, **limits}))
    box.start()
    return box


@pytest.fixture
def sb(tmp_path):
    box = make(tmp_path)
    yield box
    box.close()


@pytest.mark.skipif(not ROOT, reason="the uid switch applies when t1async runs as root")
def test_shell_is_an_unprivileged_host_uid_without_capabilities(sb):
    assert sb.exec("id -u; id -g; id -G").output.split() == [str(SANDBOX_UID)] * 3
    status = dict(line.split(":\t") for line in sb.exec("cat /proc/self/status").output.splitlines() if ":\t" in line)
    assert all(status[k].strip() == "0000000000000000" for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"))
    assert status["NoNewPrivs"].strip() == "1"
    assert sb.mechanisms()["uid"] == str(SANDBOX_UID)


def test_host_files_cannot_be_read_or_written(sb, tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("do not read\n")
    for probe in (f"cat {secret}", "cat /etc/shadow", "cat /proc/1/root/etc/shadow", f"ls /proc/1/root{tmp_path}"):
        result = sb.exec(probe)
        assert result.exit_code != 0 and "do not read" not in result.output, probe
    # /work holds nothing but, where the interpreter's venv lies below it, the way down to it
    skeleton = python_skeleton("/work")
    result = sb.exec("ls -A /work")
    assert (result.exit_code != 0) if skeleton is None else set(result.output.split()) <= skeleton, result.output
    for target in ("/usr/bin/t1async-probe", "/etc/t1async-probe", "/t1async-probe", "/tests/probe"):
        assert sb.exec(f"touch {target}").exit_code != 0, target
    assert not Path("/usr/bin/t1async-probe").exists() and not Path("/etc/t1async-probe").exists()


def test_no_network(sb):
    result = sb.exec("python3 -c \"import socket; s = socket.socket(); s.settimeout(2); s.connect(('1.1.1.1', 443))\"")
    assert result.exit_code != 0
    assert sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").output.split() == ["lo"]


def test_host_processes_cannot_be_signalled(sb):
    victim = subprocess.Popen(["sleep", str(random.randrange(10**6, 10**7))])
    try:
        assert sb.exec(f"kill -9 {victim.pid}").exit_code != 0
        sb.exec("kill -9 -1 2>/dev/null; true")  # every process the shell can see: only its own
        time.sleep(0.2)
        assert victim.poll() is None, "a host process was killed from inside the sandbox"
        assert sb.exec("ps -e | wc -l").output.split()[-1].isdigit()
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.skipif(not CGROUPS, reason="needs writable cgroup v1 pids/memory controllers")
def test_fork_bomb_is_capped_and_reported(sb):
    result = sb.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout_s=2.0)
    assert result.timed_out and "processes" in result.refused, result.output
    assert "process limit (32) reached" in result.output
    assert len(open(sb._group.groups["pids"] / "cgroup.procs").read().split()) <= 32
    assert sb.exec("echo survived").output.endswith("survived\n")


@pytest.mark.skipif(not CGROUPS, reason="needs writable cgroup v1 pids/memory controllers")
def test_memory_is_capped_and_reported(sb):
    result = sb.exec("python3 -c 'x = bytearray(400 << 20); print(len(x))'", timeout_s=20)
    assert result.exit_code != 0 and "memory" in result.refused, result.output
    assert "memory limit (128 MiB) reached" in result.output
    assert sb.exec("echo ok").output == "ok\n"


@pytest.mark.skipif(not ROOT, reason="the tmpfs disk needs mount(2) (root)")
def test_disk_is_capped_and_reported(sb, tmp_path):
    result = sb.exec("head -c 20000000 /dev/zero > /app/fill; echo rc=$?", timeout_s=20)
    assert "No space left" in result.output and "disk" in result.refused
    assert os.path.getsize(tmp_path / "app" / "fill") <= 8 << 20
    assert sb.exec("rm /app/fill && echo freed").output == "freed\n"
    assert sb.exec("head -c 20000000 /dev/zero > /tmp/fill; echo rc=$?").output.strip().endswith("rc=1")


def test_file_size_and_cpu_time_rlimits(tmp_path):
    box = make(tmp_path, max_file_mb=1, cpu_time_s=1, disk_mb=0)
    try:
        big = box.exec("head -c 3000000 /dev/zero > /app/big; echo rc=$?")
        assert "rc=153" in big.output or "File size limit exceeded" in big.output  # SIGXFSZ
        assert os.path.getsize(tmp_path / "app" / "big") <= 1 << 20
        started = time.monotonic()
        spin = box.exec("python3 -c 'while True: pass'; echo rc=$?", timeout_s=15)
        assert "rc=152" in spin.output or "rc=137" in spin.output  # SIGXCPU or SIGKILL at the hard limit
        assert time.monotonic() - started < 10
    finally:
        box.close()


def test_daemons_do_not_outlive_the_episode(tmp_path):
    box = make(tmp_path)
    mark = str(random.randrange(10**6, 10**7))
    box.exec(f"python3 -c \"import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
             f"        os.execvp('sleep', ['sleep', '{mark}'])\" ; nohup sleep {int(mark) + 1} >/dev/null 2>&1 &")
    time.sleep(0.3)
    groups = dict(box._group.groups)
    box.close()
    survivors = subprocess.run(["pgrep", "-f", f"sleep ({mark}|{int(mark) + 1})"], capture_output=True, text=True)
    assert survivors.stdout.strip() == ""
    assert all(not folder.exists() for folder in groups.values()), "cgroups left behind"
    assert not os.path.ismount(tmp_path / "app")


def test_escalation_through_mount_and_namespaces_is_contained(sb):
    assert sb.exec("mount -t tmpfs none /app").exit_code != 0
    assert sb.exec("mount -o remount,rw /usr").exit_code != 0
    nested = sb.exec("unshare -rm sh -c 'mount -o remount,rw /usr && touch /usr/t1async-escape' 2>&1; echo rc=$?")
    assert not nested.output.strip().endswith("rc=0") and not Path("/usr/t1async-escape").exists()
    assert sb.exec("nsenter -t 1 -m -p true").exit_code != 0
    assert sb.exec("chroot / true").exit_code != 0
    su = sb.exec("su -c id root </dev/null; sudo -n id")
    assert "uid=0" not in su.output or not ROOT
    assert sb.exec("ls /sys/fs/cgroup").exit_code != 0 or "t1async" not in sb.exec("ls /sys/fs/cgroup").output
