import os
import stat
import subprocess

SCRIPT = "/app/run.sh"


def test_owner_execute_bit():
    assert os.stat(SCRIPT).st_mode & stat.S_IXUSR, "owner execute bit not set"


def test_executable_for_current_user():
    assert os.access(SCRIPT, os.X_OK)


def test_script_runs_directly_and_is_unchanged():
    r = subprocess.run([SCRIPT], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0
    assert r.stdout.strip() == "service ready"
    with open(SCRIPT) as f:
        assert f.read() == '#!/bin/bash\necho "service ready"\n'
