#!/bin/bash
cd /app/project
git log --format=%H -S 'RETRIES = 7' -- settings.py | tail -n 1 > /app/answer.txt
