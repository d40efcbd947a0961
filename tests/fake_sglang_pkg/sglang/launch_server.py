"""``python -m sglang.launch_server`` stand-in: the fake server of tests/support/sglang_fake.py."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout: tests.support
    from tests.support.sglang_fake import main

    main()
