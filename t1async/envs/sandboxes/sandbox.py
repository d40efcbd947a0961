"""Sandboxes: one persistent, isolated shell per episode; backends chosen by config.

The contract every backend implements is :class:`~t1async.envs.protocol.Sandbox` (start, exec,
put, clear, read, close); the episode code never names a backend. Backends, by config key
``env.sandbox``:

* ``local`` (:class:`~t1async.envs.sandboxes.local.LocalSandbox`): bubblewrap on this host, as an
  unprivileged uid, with cgroup/tmpfs/rlimit limits;
* ``container`` (:class:`~t1async.envs.sandboxes.container.ContainerSandbox`): an OCI container per
  episode built from the task's own Dockerfile by podman or docker (offline base images:
  ``t1async images bootstrap``);
* ``modal`` (:class:`~t1async.envs.sandboxes.modal_sandbox.ModalSandbox`): a Modal cloud sandbox built
  from the task's Dockerfile or image (needs the optional ``modal`` package and credentials).

This module re-exports the contract's types so callers import from one place.
"""

from __future__ import annotations

from ..images.engine import check_container_available
from ..protocol import (
    ROOTS,
    SANDBOX_BIN,
    CommandResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxSpec,
    SandboxUnavailable,
    bash_quote,
    sandbox_environment,
)
from .container import ContainerSandbox
from .hostfs import ETC_ENTRIES, check_local_available
from .local import LocalSandbox
from .modal_sandbox import ModalSandbox, check_modal_available

__all__ = [
    "ETC_ENTRIES", "ROOTS", "SANDBOX_BIN", "SANDBOXES", "CommandResult", "ContainerSandbox", "LocalSandbox", "ModalSandbox",
    "Sandbox",
    "SandboxError", "SandboxLimits", "SandboxSpec", "SandboxUnavailable", "bash_quote", "check_sandbox_available",
    "make_sandbox", "sandbox_environment",
]

SANDBOXES: dict[str, type] = {"local": LocalSandbox, "container": ContainerSandbox, "modal": ModalSandbox}
"""Sandbox backends by name (config ``env.sandbox``); each class has ``from_spec(spec)``."""

_CHECKS = {"local": check_local_available, "container": check_container_available, "modal": check_modal_available}
_available: set[str] = set()


def check_sandbox_available(backend: str = "local") -> None:
    """Check that ``backend`` can run here (a success is remembered for the process; the Modal
    check only looks for the package and credentials, never the network).

    Raises:
        SandboxUnavailable: with a one-line message saying what to install or change.
    """
    if backend in _available:
        return
    if backend not in SANDBOXES:
        raise SandboxUnavailable(f"unknown sandbox backend {backend!r}: choose one of {sorted(SANDBOXES)}")
    _CHECKS[backend]()
    _available.add(backend)


def make_sandbox(backend: str, spec: SandboxSpec) -> Sandbox:
    """The ``backend`` sandbox for ``spec`` (not started).

    Raises:
        SandboxUnavailable: unknown backend, or it cannot run here.
    """
    check_sandbox_available(backend)
    return SANDBOXES[backend].from_spec(spec)
