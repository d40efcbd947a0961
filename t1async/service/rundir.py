"""The run directory as something a service owns: one holder at a time, no silent mixing of runs.

    RUN_DIR/service.lock    flock-ed by the launch process for its whole life (the kernel releases
                            it when that process dies, however it dies: kill -9 included)
    RUN_DIR/service.json    who holds it: pid, host, start time, the control address
                            (``control``, t1async/service/control.py), the learner's trajectory
                            socket (``trajectories``, the address rollout actors push to; the same
                            after a learner restart), the Ray session; removed at a clean exit
    RUN_DIR/config_history.jsonl   live changes (``t1async scale``), one JSON object a line;
                            a resume applies them again so it keeps what was changed live

A second ``launch`` into a held directory is refused in one line naming the holder. A directory
that holds an earlier run (metrics, checkpoints, a receive log) is refused unless the launch
resumes it (``learner.resume=true``) or asks to start over (``run.overwrite=true``, which deletes
the earlier run's files first); ``learner.resume=true`` into one that holds no run is refused too
(:func:`check_resumable`: a mistyped path must not start from scratch). A holder killed with
SIGKILL leaves ``service.json`` behind with its lock free: the next launch takes the directory
over (and cleans up what it left, see :func:`stale_holder`).

Errors are :class:`~t1async.config.ConfigError` (bad input: one line, exit status 2).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from t1async.fileio import replace_file


def _config_error(message: str) -> Exception:
    """A :class:`~t1async.config.ConfigError` (bad input: one line, exit status 2)."""
    from t1async.config import ConfigError  # (t1async.config and its yaml: deferred, t1async status stays light)

    return ConfigError(message)

LOCK_FILE = "service.lock"
SERVICE_FILE = "service.json"
HISTORY_FILE = "config_history.jsonl"
EARLIER_RUN = ("metrics.jsonl", "checkpoints", "receive_log", "spool", "quarantine", "summary.json", "episodes",
               "tensorboard", "trajectories", HISTORY_FILE)
"""Entries that make a folder hold an earlier run (deleted by ``run.overwrite=true``)."""


def resolve_run_dir(template: str) -> Path:
    """``run.dir`` with ``{now}`` replaced by the UTC time ``YYYYmmdd-HHMMSS``, made absolute.

    Raises:
        ConfigError: braces other than ``{now}`` (a typo such as ``{date}`` or a stray ``{``).
    """
    now = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    others = re.sub(r"\{now\}", "", template)
    if "{" in others or "}" in others:
        raise _config_error(f"run.dir={template!r}: the only placeholder is {{now}} (UTC time); "
                          "remove the other braces")
    return Path(template.replace("{now}", now)).resolve()


class RunDirLock:
    """This process's hold on a run directory (``service.lock`` flock-ed; ``service.json`` on :meth:`write`).

    Args:
        run_dir: the folder (created).

    Raises:
        ConfigError: another live process holds it (the message names it), or it cannot be created.
    """

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.dir / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            raise _config_error(f"run.dir {self.dir} cannot be created ({e.strerror}); pick a writable folder") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            raise _config_error(f"run.dir {self.dir} is in use by {describe_holder(read_service(self.dir))}; "
                              f"stop it with `t1async stop {self.dir}` or pick another run.dir") from None
        self.previous = read_service(self.dir)  # what a holder that died without cleaning up left (or None)
        self.info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}

    def write(self, **fields: Any) -> None:
        """Add ``fields`` (e.g. ``control=ADDRESS``) to ``service.json`` (replaced atomically)."""
        self.info.update(fields)
        replace_file(self.dir / SERVICE_FILE, json.dumps(self.info))

    def release(self) -> None:
        """Remove ``service.json`` (if this process wrote it) and give up the lock (idempotent)."""
        if self._fd < 0:
            return
        if read_service(self.dir) == self.info:
            (self.dir / SERVICE_FILE).unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1


def read_service(run_dir: Path) -> dict[str, Any] | None:
    """The holder's ``service.json``, or None when there is none or it is unreadable."""
    try:
        return json.loads((Path(run_dir) / SERVICE_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_held(run_dir: Path) -> bool:
    """Whether a live process holds ``run_dir`` (its lock cannot be taken)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock this probe took
    return False


def describe_holder(info: dict[str, Any] | None) -> str:
    """``"t1async launch pid 123 on host h since 2026-...Z"`` (or a vaguer phrase without ``info``)."""
    if not info:
        return "another t1async launch (its service.json is not written yet)"
    since = datetime.fromtimestamp(info.get("started", 0), timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    return f"t1async launch pid {info.get('pid')} on host {info.get('host')} since {since}"


def earlier_run(run_dir: Path) -> str | None:
    """A short description of the earlier run ``run_dir`` holds (``"metrics to step 12, 2
    checkpoints"``), or None when it holds none."""
    d = Path(run_dir)
    found = [name for name in EARLIER_RUN if (d / name).exists()]
    if not found:
        return None
    parts = []
    metrics = d / "metrics.jsonl"
    if metrics.exists():
        lines = [x for x in metrics.read_text().splitlines() if x.strip()]
        parts.append(f"metrics to step {json.loads(lines[-1]).get('step', '?')}" if lines else "empty metrics")
    ckpts = list((d / "checkpoints").glob("step_*")) if (d / "checkpoints").is_dir() else []
    if ckpts:
        parts.append(f"{len(ckpts)} checkpoints")
    return ", ".join(parts) or ", ".join(found)


def check_reuse(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to mix a new run with the earlier run ``run_dir`` holds; with ``overwrite`` delete it.

    Raises:
        ConfigError: it holds an earlier run and neither ``resume`` nor ``overwrite`` was asked for.
    """
    what = earlier_run(run_dir)
    if what is None or resume:
        return
    if not overwrite:
        raise _config_error(f"run.dir {run_dir} holds an earlier run ({what}); resume it with learner.resume=true, "
                          "start over with run.overwrite=true (deletes it), or pick another run.dir")
    for name in (*EARLIER_RUN, "logs", "workspaces", "config.yaml"):
        p = Path(run_dir) / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def append_history(run_dir: Path, changes: dict[str, Any], source: str) -> None:
    """Record live ``changes`` (``{dotted key: value}``) from ``source`` in ``config_history.jsonl``."""
    with open(Path(run_dir) / HISTORY_FILE, "a") as f:
        f.write(json.dumps({"time": time.time(), "source": source, "changes": changes}) + "\n")


def history_overrides(run_dir: Path) -> list[str]:
    """The live changes recorded in ``run_dir`` as ``key=value`` overrides, oldest first (a later
    change of a key wins when they are applied in order)."""
    path = Path(run_dir) / HISTORY_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            for key, value in json.loads(line)["changes"].items():
                out.append(f"{key}={json.dumps(value)}")
    return out
