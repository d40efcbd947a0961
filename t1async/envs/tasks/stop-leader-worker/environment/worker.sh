#!/bin/bash
# usage: worker.sh ROLE -- idles until it receives SIGTERM
role=$1
mkdir -p /app/.state /app/stopped
echo $$ > "/app/.state/$role.pid"
trap 'echo "$role stopped by SIGTERM" > "/app/stopped/$role"; exit 0' TERM
while true; do sleep 0.2; done
