import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

SCRIPT = "/app/average.py"


@pytest.fixture
def tmp_path():
    # scratch inputs live under /app: the verifier relies on nothing outside /app and /tests
    d = Path(tempfile.mkdtemp(prefix=".verify_", dir="/app"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run(tmp_path, text):
    f = tmp_path / "input.txt"
    f.write_text(text)
    return subprocess.run(["python3", SCRIPT, str(f)], capture_output=True, text=True, timeout=20)


def test_integers(tmp_path):
    r = _run(tmp_path, "1\n2\n3\n4\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "average: 2.50"


def test_decimals(tmp_path):
    r = _run(tmp_path, "0.5\n1.25\n3\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "average: 1.58"


def test_blank_lines_ignored(tmp_path):
    r = _run(tmp_path, "\n10\n\n20\n\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "average: 15.00"


def test_empty_file(tmp_path):
    r = _run(tmp_path, "\n\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "average: n/a"


def test_provided_numbers_file():
    r = subprocess.run(["python3", SCRIPT, "/app/numbers.txt"], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "average: 7.50"
