import subprocess
from pathlib import Path

REPO = "/app/repo"


def _main_tip():
    return Path("/app/.main_tip").read_text().strip()


def _git(*args):
    r = subprocess.run(["git", "-c", "safe.directory=*", "-C", REPO, *args], capture_output=True, text=True)
    return r.returncode, r.stdout.strip()


def test_branch_exists():
    rc, _ = _git("rev-parse", "--verify", "refs/heads/feature/greeting")
    assert rc == 0, "branch feature/greeting does not exist"


def test_branch_has_greeting_file():
    rc, out = _git("show", "feature/greeting:greeting.txt")
    assert rc == 0, "greeting.txt is not committed on feature/greeting"
    assert out == "Hello, team!"


def test_branch_starts_from_main():
    rc, out = _git("rev-list", "--count", f"{_main_tip()}..feature/greeting")
    assert rc == 0 and out == "1", f"expected exactly one commit on top of main, got {out}"
    rc, _ = _git("merge-base", "--is-ancestor", _main_tip(), "feature/greeting")
    assert rc == 0


def _branch_exists():
    return _git("rev-parse", "--verify", "refs/heads/feature/greeting")[0] == 0


def test_main_unchanged():
    assert _branch_exists(), "branch feature/greeting does not exist"
    rc, out = _git("rev-parse", "refs/heads/main")
    assert rc == 0 and out == _main_tip(), "main was modified"


def test_back_on_main():
    assert _branch_exists(), "branch feature/greeting does not exist"
    rc, out = _git("symbolic-ref", "--short", "HEAD")
    assert rc == 0 and out == "main"
    assert not Path(REPO, "greeting.txt").exists(), "greeting.txt should not be in main's working tree"
