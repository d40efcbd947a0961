"""t1async: asynchronous actor-critic RL for Mixture-of-Experts terminal agents.

The data path is readable top-down from :func:`t1async.service.launch.launch`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__version__ = "0.1.0"


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
