"""Shared set-up of the container tests: the engine and one bootstrapped base image.

:func:`base_image` returns ``python:3.13-slim`` after making sure it and ``ubuntu:24.04``
(the shipped tasks' base) resolve locally: on a fresh machine with podman (``tools/setup.sh``
installs it) and mmdebstrap it bootstraps their one Debian trixie stand-in once (about 1-3
minutes); podman's storage keeps it for later runs. Without podman the calling test is
skipped with the reason.
"""

from __future__ import annotations

import functools
import shutil

import pytest

BASE = "python:3.13-slim"
"""The image container tests run in (Debian trixie stand-in: python3, pip, venv, procps; not
``python:3.13-slim-bookworm``, whose stand-in builds CPython from source, minutes on a fresh machine)."""

NAMES = (BASE, "ubuntu:24.04")
"""Every base image the container tests use (one trixie root filesystem serves both; the fixtures
are written FROM them). Only the ``slow`` test of the CPython-on-bookworm stand-in in
tests/unit/envs/test_images.py builds that one (about 10 minutes once per machine)."""


@functools.lru_cache(maxsize=1)
def _prepare() -> str:
    """"" when ready, else why not."""
    if shutil.which("podman") is None:
        return "podman is not installed (tools/setup.sh installs it with apt-get where it can)"
    from t1async.envs.images.engine import resolve_engine
    from t1async.envs.images.stand_ins import bootstrap
    from t1async.envs.protocol import SandboxError

    try:
        bootstrap(resolve_engine(), list(NAMES))
    except SandboxError as exc:
        return f"the base image could not be bootstrapped: {exc}"
    return ""


def base_image() -> str:
    """:data:`BASE`, ready; skips the calling test when podman or the bootstrap is unavailable."""
    why = _prepare()
    if why:
        pytest.skip(why)
    return BASE
