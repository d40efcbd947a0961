#!/bin/bash
cut -d' ' -f1 /app/access.log | sort | uniq -c | sort -rn | head -n 3 > /app/top_ips.txt
