import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

SCRIPT = "/app/wordfreq.py"


@pytest.fixture
def scratch():
    d = Path(tempfile.mkdtemp(prefix=".verify_", dir="/app"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run(path, n):
    r = subprocess.run(["python3", SCRIPT, str(path), str(n)], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    return [line.rstrip() for line in r.stdout.strip().splitlines()]


def test_script_exists():
    assert Path(SCRIPT).is_file()


def test_sample_example():
    assert _run("/app/sample.txt", 3) == ["the 6", "dog 3", "fox 3"]


def test_case_insensitive_and_punctuation(scratch):
    f = scratch / "a.txt"
    f.write_text("Apple, apple; APPLE! banana-Banana cherry\n")
    assert _run(f, 2) == ["apple 3", "banana 2"]


def test_ties_alphabetical(scratch):
    f = scratch / "b.txt"
    f.write_text("zeta alpha mid zeta alpha mid omega\n")
    assert _run(f, 4) == ["alpha 2", "mid 2", "zeta 2", "omega 1"]


def test_non_letters_split_words(scratch):
    f = scratch / "c.txt"
    f.write_text("it's x2y don't it\n")
    assert _run(f, 10) == ["it 2", "don 1", "s 1", "t 1", "x 1", "y 1"]


def test_n_larger_than_vocabulary(scratch):
    f = scratch / "d.txt"
    f.write_text("one two two\n")
    assert _run(f, 50) == ["two 2", "one 1"]
