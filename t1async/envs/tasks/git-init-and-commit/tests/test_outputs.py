import subprocess
from pathlib import Path

REPO = Path("/app/site")


def _git(*args):
    return subprocess.run(["git", "-c", "safe.directory=*", "-C", str(REPO), *args],
                          capture_output=True, text=True)


def test_is_git_repository():
    assert (REPO / ".git").is_dir(), "/app/site/.git missing"


def test_commit_message():
    r = _git("log", "-1", "--format=%s")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "Initial commit"


def test_both_files_committed():
    r = _git("ls-tree", "-r", "--name-only", "HEAD")
    assert r.returncode == 0, r.stderr
    assert {"index.html", "style.css"} <= set(r.stdout.split())


def test_working_tree_clean():
    r = _git("status", "--porcelain")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", r.stdout
