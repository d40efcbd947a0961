import sqlite3

rows = [
    (1, "978-0-00-000001-1", "Rivers of Salt", 1998),
    (2, "978-0-00-000002-8", "The Glass Orchard", 2004),
    (3, "978-0-00-000001-1", "Rivers of Salt (copy)", 1998),
    (4, "978-0-00-000003-5", "Night Ferry", 2011),
    (5, "978-0-00-000004-2", "A Map of Small Things", 2016),
    (6, "978-0-00-000002-8", "The Glass Orchard", 2005),
    (7, "978-0-00-000005-9", "Copper Sky", 2020),
    (8, "978-0-00-000002-8", "Glass Orchard, The", 2004),
    (9, "978-0-00-000006-6", "Field Notes", 1987),
    (10, "978-0-00-000004-2", "A Map of Small Things", 2016),
    (11, "978-0-00-000007-3", "Low Tide", 2009),
]
con = sqlite3.connect("library.db")
con.execute("CREATE TABLE books (id INTEGER PRIMARY KEY, isbn TEXT NOT NULL, title TEXT, year INTEGER)")
con.executemany("INSERT INTO books VALUES (?, ?, ?, ?)", rows)
con.commit()
