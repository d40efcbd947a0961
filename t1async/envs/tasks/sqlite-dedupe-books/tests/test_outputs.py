import sqlite3

DB = "/app/library.db"
KEPT = [
    (1, "978-0-00-000001-1", "Rivers of Salt", 1998),
    (2, "978-0-00-000002-8", "The Glass Orchard", 2004),
    (4, "978-0-00-000003-5", "Night Ferry", 2011),
    (5, "978-0-00-000004-2", "A Map of Small Things", 2016),
    (7, "978-0-00-000005-9", "Copper Sky", 2020),
    (9, "978-0-00-000006-6", "Field Notes", 1987),
    (11, "978-0-00-000007-3", "Low Tide", 2009),
]


def _query(sql):
    con = sqlite3.connect(f"file:{DB}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_no_duplicate_isbns():
    assert _query("SELECT isbn FROM books GROUP BY isbn HAVING COUNT(*) > 1") == []


def test_kept_smallest_ids():
    assert [r[0] for r in _query("SELECT id FROM books ORDER BY id")] == [r[0] for r in KEPT]


def test_kept_rows_unchanged():
    assert _query("SELECT id, isbn, title, year FROM books ORDER BY id") == KEPT


def test_unique_index_exists():
    idx = {r[1]: r for r in _query("PRAGMA index_list(books)")}
    assert "idx_books_isbn" in idx, "index idx_books_isbn not found"
    assert idx["idx_books_isbn"][2] == 1, "idx_books_isbn is not UNIQUE"
    cols = [r[2] for r in _query("PRAGMA index_info(idx_books_isbn)")]
    assert cols == ["isbn"]
