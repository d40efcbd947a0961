import sqlite3
from pathlib import Path

DB = Path("/app/inventory.db")


def _connect():
    assert DB.is_file(), "/app/inventory.db missing"
    return sqlite3.connect(f"file:{DB}?mode=ro", uri=True)


def test_database_file_is_sqlite():
    assert DB.is_file(), "/app/inventory.db missing"
    assert DB.read_bytes()[:16] == b"SQLite format 3\x00"


def test_items_table_exists():
    with _connect() as con:
        row = con.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='items'").fetchone()
    assert row is not None, "table items not found"


def test_items_columns():
    with _connect() as con:
        cols = [(r[1], r[2].upper(), r[5]) for r in con.execute("PRAGMA table_info(items)")]
    assert [c[0] for c in cols] == ["id", "name", "qty"]
    assert cols[0][1] == "INTEGER" and cols[0][2] == 1, "id must be INTEGER PRIMARY KEY"


def test_items_rows():
    with _connect() as con:
        rows = con.execute("SELECT id, name, qty FROM items ORDER BY id").fetchall()
    assert rows == [(1, "bolt", 120), (2, "nut", 300), (3, "washer", 75)]
