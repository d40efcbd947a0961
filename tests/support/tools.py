"""A ``tools/`` script as a module, for the tests of that very script.

``tools/`` is no package: its scripts run by path (``python tools/NAME.py``, ``t1async bench NAME``). What
other tests need from a script lives in ``tests/support/`` or in the package; a test of a script's own
functions (a bench's split or classification rules) loads the script here, by path, under its file name.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.support import REPO


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` loaded as the module ``<name>`` (its ``__main__`` block not run).

    Raises:
        FileNotFoundError: no such script in tools/.
    """
    path = REPO / "tools" / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such tools/ script")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
