#!/bin/bash
cd /app
bash /app/spawn_workers.sh
pid=$(pgrep -f '^bash /app/worker.sh leader$' | head -n 1)
echo "$pid" > /app/leader.pid
kill "$pid"
for _ in $(seq 50); do [ -f /app/stopped/leader ] && break; sleep 0.1; done
