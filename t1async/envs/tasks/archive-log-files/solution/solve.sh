#!/bin/bash
cd /app
find logs -type f -name '*.log' | sort | tar -czf logs_backup.tar.gz -T -
