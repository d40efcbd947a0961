import re
import subprocess
from pathlib import Path

ANSWER = Path("/app/answer.txt")


def _expected():
    r = subprocess.run(["git", "-c", "safe.directory=*", "-C", "/app/project", "log", "--all",
                        "--format=%H %s"], capture_output=True, text=True, check=True)
    for line in r.stdout.splitlines():
        sha, subject = line.split(" ", 1)
        if subject == "Tune network settings":
            return sha
    raise AssertionError("reference commit not found")


def test_answer_exists():
    assert ANSWER.is_file(), "/app/answer.txt missing"


def test_answer_is_full_hash():
    assert re.fullmatch(r"[0-9a-f]{40}", ANSWER.read_text().strip()), ANSWER.read_text()


def test_answer_is_introducing_commit():
    assert ANSWER.read_text().strip() == _expected()
