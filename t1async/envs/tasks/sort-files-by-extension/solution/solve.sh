#!/bin/bash
cd /app
for f in inbox/*; do
  b=$(basename "$f")
  case "$b" in
    *.*) ext="${b##*.}" ;;
    *) ext=noext ;;
  esac
  mkdir -p "sorted/$ext"
  mv "$f" "sorted/$ext/"
done
