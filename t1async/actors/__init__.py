"""Ray actor roles (plain classes; ``ray.remote`` is applied in :mod:`t1async.service.launch`)."""

import re
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FRAME = re.compile(r'\s+File ".*", line \d+')  # a traceback frame's first line


def call(method: Any, *args: Any) -> Any:
    """Call a plain method or a Ray actor method alike (one config, two runtimes).

    A Ray actor method has ``.remote``; its result is waited for with ``ray.get``.
    """
    if hasattr(method, "remote"):
        import ray  # (ray: deferred; the plain-class runtime, tests and one process, never imports it)

        return ray.get(method.remote(*args))
    return method(*args)


class Plain:
    """A plain object or a Ray actor handle whose methods are called alike, as plain methods
    (:func:`call`), so that library code (t1async/learner/loop.py) never sees Ray.

    ``hasattr(Plain(x), name)`` is ``hasattr(x, name)``.
    """

    def __init__(self, target: Any):
        self._target = target

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._target, name)
        return lambda *args: call(method, *args)


def error_line(e: BaseException, limit: int = 300) -> str:
    """One line (at most ``limit`` characters) naming what went wrong in ``e``.

    A Ray error raised for a remote failure (``ActorDiedError`` of an actor whose ``__init__``
    raised, ``RayTaskError`` of a method that raised) carries the remote traceback in its text;
    its cause is the exception line after the traceback's last frame: ``Type: first line of the
    message`` (the type without its module path, terminal colour codes removed). Any other
    error: the first line of its text, or its type's name when the text is empty.
    """
    lines = _ANSI.sub("", str(e)).strip().splitlines()
    frames = [i for i, x in enumerate(lines) if _FRAME.match(x)]
    if frames:
        line = next((x for x in lines[frames[-1] + 1:] if x.strip() and not x[0].isspace()), "")
        head, sep, msg = line.partition(": ")
        if re.fullmatch(r"[\w.]+", head):
            line = f"{head.rsplit('.', 1)[-1]}{sep}{msg}"
        if line:
            return line[:limit]
    return (lines or [type(e).__name__])[0][:limit]


MEMORY_KILL_WORDS = ("running low on memory",)
"""What Ray's memory monitor writes into the error of a role it killed ("4 worker(s) were killed due
to the node running low on memory ..."). Not "OOM" alone: Ray's text for any unexpected death (a
kill -9) lists the kernel's OOM killer among its possible causes."""


def killed_for_memory(error: BaseException | str) -> bool:
    """Whether a role's death error says Ray's memory monitor killed it (an ``OutOfMemoryError``,
    or its text: :data:`MEMORY_KILL_WORDS`)."""
    if type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error).lower()
    return any(word in text for word in MEMORY_KILL_WORDS)


__all__ = ["Plain", "call", "error_line", "killed_for_memory"]
