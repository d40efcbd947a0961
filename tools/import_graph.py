"""The import graph of t1async's own modules: circles, upward imports, folders importing each other.

    python tools/import_graph.py            # circles, upward imports, folder pairs, then counts
    python tools/import_graph.py --list     # also every function-level import, one a line
    python tools/import_graph.py --check    # exit status 1 when any of the three is not empty
    python tools/import_graph.py --root DIR # another checkout's t1async/ (a worktree of an older commit)

A thin CLI over ``tests/support/import_graph.py`` (the graph and the layer table the architecture test
asserts on; one copy of each).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.import_graph import main  # noqa: E402  (the checkout's top folder is on the path now)

if __name__ == "__main__":
    raise SystemExit(main())
