"""The container sandbox's shell start survives a transient engine exec failure.

runc's ``exec`` fails with ``read init-p: connection reset by peer`` while the container's pids
cgroup is full (seen in CI: a fork bomb that outlived its timeout kill on a loaded machine). The engine
here is a real script standing in for podman: its ``exec`` runs the command on this host, and its
first ``exec -i`` sessions fail the way runc does. The sandbox code under test is the real one.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from t1async.envs.images.engine import Engine
from t1async.envs.protocol import SandboxError, SandboxSpec
from t1async.envs.sandboxes.container import SHELL_START_TRIES, ContainerSandbox

FAKE_ENGINE = r"""#!/usr/bin/env bash
# exec [-i] [--user U] [-w DIR] [-e K=V]... NAME ARGV...: runs ARGV here; the first FAILS sessions fail.
[ "$1" = exec ] || exit 2; shift
session=0; dir=.
while [ $# -gt 0 ]; do
  case "$1" in
    -i) session=1; shift ;;
    --user) shift 2 ;;
    -w) dir="$2"; shift 2 ;;
    -e) export "$2"; shift 2 ;;
    *) break ;;
  esac
done
shift  # the container name
if [ "$session" = 1 ] && [ "$#" -gt 2 ] && [ "$1" = bash ]; then
  n=$(( $(cat "$COUNT" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$COUNT"
  if [ "$n" -le "$FAILS" ]; then
    echo "Error: OCI runtime error: runc: exec failed: unable to start container process: read init-p: connection reset by peer"
    exit 126
  fi
fi
cd "$dir" && exec "$@"
"""


def _box(tmp_path: Path, monkeypatch, fails: int) -> ContainerSandbox:
    script = tmp_path / "engine"
    script.write_text(FAKE_ENGINE)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("COUNT", str(tmp_path / "sessions"))
    monkeypatch.setenv("FAILS", str(fails))
    monkeypatch.setattr("time.sleep", lambda s: None)
    box = ContainerSandbox(SandboxSpec(episode_dir=tmp_path, workdir=str(tmp_path / "app")))
    box.engine, box.name, box.image = Engine("podman", [str(script)]), "fake", "fake-image"
    box.kills = []  # the real kill would signal this host's processes: record the calls instead
    monkeypatch.setattr(box, "_kill_commands", lambda: box.kills.append(box._shell_pid) or 0)
    return box


def test_a_shell_whose_first_exec_sessions_fail_transiently_is_started_again(tmp_path, monkeypatch):
    box = _box(tmp_path, monkeypatch, fails=SHELL_START_TRIES - 1)
    try:
        box._start_shell()
        assert (tmp_path / "sessions").read_text().strip() == str(SHELL_START_TRIES)
        assert box.kills == [0] * (SHELL_START_TRIES - 1), "each retry first clears the container, old shell too"
        result = box.exec("pwd; echo $((6 * 7))")
        assert result.exit_code == 0 and result.output.split() == [str(tmp_path / "app"), "42"], result.output
    finally:
        box._stop_shell()


def test_a_shell_that_never_answers_is_refused_naming_the_engine_output_and_the_tries(tmp_path, monkeypatch):
    box = _box(tmp_path, monkeypatch, fails=SHELL_START_TRIES)
    with pytest.raises(SandboxError, match=rf"read init-p.*try {SHELL_START_TRIES} of {SHELL_START_TRIES}"):
        box._start_shell()
    assert (tmp_path / "sessions").read_text().strip() == str(SHELL_START_TRIES)
    box._stop_shell()
