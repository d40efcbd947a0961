#!/bin/bash
cat > /app/wordfreq.py <<'PY'
import re
import sys
from collections import Counter


def main():
    path, n = sys.argv[1], int(sys.argv[2])
    with open(path) as f:
        words = re.findall(r"[a-z]+", f.read().lower())
    counts = Counter(words)
    for word, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]:
        print(f"{word} {count}")


if __name__ == "__main__":
    main()
PY
