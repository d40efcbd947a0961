"""Regenerate (or check) the committed SGLang protocol fixture from the pinned SGLang release's own source.

    python tools/sglang_schema.py            # rewrite tests/fixtures/sglang_schema.json from the pinned release
    python tools/sglang_schema.py --check    # exit 1 and print the difference if they disagree
    python tools/sglang_schema.py --version 0.5.10.post1   # pin another release (then commit)

A thin CLI over ``tests/support/sglang_schema.py`` (what the fixture records, and the wheel download the
contract tests share).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.sglang_schema import main  # noqa: E402  (the checkout's top folder is on the path now)

if __name__ == "__main__":
    raise SystemExit(main())
