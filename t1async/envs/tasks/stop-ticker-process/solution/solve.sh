#!/bin/bash
cd /app
python3 /app/ticker.py &
pid=$!
while [ "$(cat ticks.log 2>/dev/null | wc -l)" -lt 5 ]; do sleep 0.2; done
kill "$pid"
wait "$pid"
