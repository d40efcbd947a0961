import os
import stat
from pathlib import Path

LISTING = Path("/app/world_writable.txt")
EXPECTED_LIST = ["data/bin/tool.sh", "data/cache/a.tmp", "data/reports/jan.csv", "data/reports/summary.md"]
EXPECTED_MODES = {
    "data/readme.txt": 0o644,
    "data/reports/jan.csv": 0o664,
    "data/reports/feb.csv": 0o640,
    "data/reports/summary.md": 0o644,
    "data/bin/tool.sh": 0o775,
    "data/bin/helper.sh": 0o755,
    "data/cache/a.tmp": 0o600,
    "data/cache/b.tmp": 0o600,
}


def _mode(rel):
    return stat.S_IMODE(os.stat(Path("/app", rel)).st_mode)


def _listed():
    lines = [l.strip() for l in LISTING.read_text().splitlines() if l.strip()]
    return [l[2:] if l.startswith("./") else l for l in lines]


def test_listing_exists():
    assert LISTING.is_file(), "/app/world_writable.txt missing"


def test_listing_content():
    assert sorted(_listed()) == EXPECTED_LIST


def test_listing_sorted():
    assert _listed() == EXPECTED_LIST


def test_no_world_writable_files_left():
    left = [rel for rel in EXPECTED_MODES if _mode(rel) & stat.S_IWOTH]
    assert not left, left


def test_other_bits_preserved():
    assert {rel: oct(_mode(rel)) for rel in EXPECTED_MODES} == {rel: oct(m) for rel, m in EXPECTED_MODES.items()}
