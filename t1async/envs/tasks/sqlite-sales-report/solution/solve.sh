#!/bin/bash
sqlite3 -header -csv /app/shop.db "SELECT c.name AS name, printf('%.2f', SUM(o.amount_cents) / 100.0) AS total
FROM customers c JOIN orders o ON o.customer_id = c.id
WHERE o.status = 'paid'
GROUP BY c.id
ORDER BY SUM(o.amount_cents) DESC, c.name;" > /app/report.csv
