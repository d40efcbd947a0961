#!/bin/bash
# starts three background workers
for role in alpha leader beta; do
  nohup bash /app/worker.sh "$role" > /dev/null 2>&1 &
done
sleep 0.5
echo "started 3 workers"
