#!/bin/bash
sqlite3 /app/library.db "DELETE FROM books WHERE id NOT IN (SELECT MIN(id) FROM books GROUP BY isbn);
CREATE UNIQUE INDEX idx_books_isbn ON books(isbn);"
