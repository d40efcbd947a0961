from pathlib import Path

SORTED = Path("/app/sorted")
EXPECTED = {
    "txt": {"summary.txt": "quarterly summary\n", "notes.txt": "remember the milk\n"},
    "csv": {"sales.csv": "id,amount\n1,20\n2,35\n", "q3.backup.csv": "id,amount\n7,11\n"},
    "log": {"boot.log": "2024-01-01 boot ok\n", "disk.log": "2024-01-02 disk warning\n"},
    "noext": {"README": "see docs\n", "Makefile": "all: build\n"},
}


def _check(ext):
    d = SORTED / ext
    assert d.is_dir(), f"{d} missing"
    names = {p.name for p in d.iterdir()}
    assert names == set(EXPECTED[ext]), f"{d} holds {sorted(names)}"
    for name, content in EXPECTED[ext].items():
        assert (d / name).read_text() == content, f"{d / name} content changed"


def test_txt_files():
    _check("txt")


def test_csv_files():
    _check("csv")


def test_log_files():
    _check("log")


def test_files_without_extension():
    _check("noext")


def test_inbox_kept_and_empty():
    inbox = Path("/app/inbox")
    assert inbox.is_dir(), "/app/inbox should still exist"
    assert list(inbox.iterdir()) == [], "/app/inbox should be empty"
