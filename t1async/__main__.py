"""``python -m t1async ARGS``: the ``t1async`` command (t1async/cli.py), for an environment without its script on PATH."""

import sys

from t1async.cli import main

sys.exit(main())
