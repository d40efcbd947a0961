"""t1async: asynchronous actor-critic RL for Mixture-of-Experts terminal agents.

The data path is readable top-down from :func:`t1async.service.launch.launch`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

__version__ = "0.1.0"

# actors/ and envs/ sit beside t1async/ in a checkout and install as t1async.actors and
# t1async.envs (pyproject's package-dir). Where this file is imported straight from a checkout's
# folder, not through an install's mapping (Ray puts the driver's working directory first on every
# worker's sys.path, so a non-editable install launched from a clone runs the clone's t1async in its
# workers), find them beside it.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "actors" / "__init__.py").is_file() and not (Path(__file__).resolve().parent / "actors").exists():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)


class MissingExtra(ImportError):
    """An optional dependency is not installed; the one-line message names the extra that brings it
    (reported by the CLI as ``t1async: error: ...``, exit status 2)."""


def require_extra(module: str, extra: str, needed_for: str) -> ModuleType:
    """Import ``module`` of the optional dependencies in pyproject's extra ``extra``.

    Raises:
        MissingExtra: ``NEEDED_FOR needs MODULE: pip install 't1async[EXTRA]'``.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{needed_for} needs {module.split('.')[0]}, which is not installed: "
                           f"pip install 't1async[{extra}]'") from None
