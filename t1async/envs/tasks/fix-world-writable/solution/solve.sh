#!/bin/bash
cd /app
find data -type f -perm -o+w | sort > world_writable.txt
find data -type f -perm -o+w -exec chmod o-w {} +
