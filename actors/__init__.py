"""Ray actor roles (plain classes; ``ray.remote`` is applied in :mod:`t1async.service.launch`)."""

from typing import Any


def call(method: Any, *args: Any) -> Any:
    """Call a plain method or a Ray actor method alike (one config, two runtimes).

    A Ray actor method has ``.remote``; its result is waited for with ``ray.get``.
    """
    if hasattr(method, "remote"):
        import ray  # (ray: deferred; the plain-class runtime, tests and one process, never imports it)

        return ray.get(method.remote(*args))
    return method(*args)
