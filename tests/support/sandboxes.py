"""What a sandbox sees of the host's Python."""

from __future__ import annotations

import sys
from pathlib import Path


def python_skeleton(folder: str) -> set[str] | None:
    """The entries of host ``folder`` the sandbox shows because the interpreter's own folders (bound
    read-only at their host paths) lie below it; None when none does."""
    from t1async.envs.sandboxes.local import _python_paths

    below = [p for p in map(Path, [*_python_paths(), sys.prefix, sys.base_prefix]) if p.is_relative_to(folder)
             and p != Path(folder)]
    return {p.relative_to(folder).parts[0] for p in below} if below else None
