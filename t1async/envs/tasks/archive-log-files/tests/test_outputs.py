import tarfile
from pathlib import Path

ARCHIVE = Path("/app/logs_backup.tar.gz")
EXPECTED = {
    "logs/app.log": b"app started\napp stopped\n",
    "logs/access.log": b"GET /\n",
    "logs/old/2023-12.log": b"december entries\n",
    "logs/old/2023-11.log": b"november entries\n",
}


def _members():
    with tarfile.open(ARCHIVE, "r:*") as tar:
        out = {}
        for m in tar.getmembers():
            if m.isfile():
                name = m.name[2:] if m.name.startswith("./") else m.name
                out[name] = tar.extractfile(m).read()
        return out


def test_archive_is_gzip():
    assert ARCHIVE.is_file(), "archive missing"
    assert ARCHIVE.read_bytes()[:2] == b"\x1f\x8b", "archive is not gzip-compressed"


def test_contains_all_log_files():
    names = set(_members())
    missing = set(EXPECTED) - names
    assert not missing, f"missing members: {sorted(missing)}"


def test_contains_only_log_files():
    extra = set(_members()) - set(EXPECTED)
    assert not extra, f"unexpected members: {sorted(extra)}"


def test_member_contents():
    members = _members()
    for name, content in EXPECTED.items():
        assert members.get(name) == content, name


def test_originals_kept():
    for name, content in EXPECTED.items():
        assert (Path("/app") / name).read_bytes() == content
