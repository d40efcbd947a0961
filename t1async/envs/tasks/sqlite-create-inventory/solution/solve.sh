#!/bin/bash
sqlite3 /app/inventory.db "CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT NOT NULL, qty INTEGER);
INSERT INTO items (id, name, qty) VALUES (1, 'bolt', 120), (2, 'nut', 300), (3, 'washer', 75);"
