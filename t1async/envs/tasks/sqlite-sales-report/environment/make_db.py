import random
import sqlite3

r = random.Random(2024)
con = sqlite3.connect("shop.db")
con.executescript("""
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id),
                     amount_cents INTEGER NOT NULL, status TEXT NOT NULL);
""")
customers = [(1, "Alice", "Lyon"), (2, "Bruno", "Porto"), (3, "Chen", "Oslo"), (4, "Dana", "Lyon"),
             (5, "Emeka", "Accra"), (6, "Farah", "Oslo"), (7, "Goran", "Split")]
con.executemany("INSERT INTO customers VALUES (?, ?, ?)", customers)
oid = 1
for cid in range(1, 8):
    for _ in range(r.randint(2, 6)):
        status = r.choice(["paid", "paid", "paid", "refunded", "pending"])
        if cid == 7:
            status = "pending"          # Goran has no paid order
        con.execute("INSERT INTO orders VALUES (?, ?, ?, ?)", (oid, cid, r.randint(500, 25000), status))
        oid += 1
con.commit()
