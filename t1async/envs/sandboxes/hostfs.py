"""Host-side helpers of the ``local`` sandbox backend: what of the host is bound into the sandbox,
whether bubblewrap can run here, and file operations that never follow a sandbox-made symlink."""

from __future__ import annotations

import fnmatch
import functools
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from ..protocol import SandboxUnavailable

ETC_ENTRIES = (
    "passwd", "group", "hosts", "hostname", "host.conf", "nsswitch.conf", "gai.conf",
    "networks", "protocols", "services", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
    "alternatives", "localtime", "timezone", "locale.alias", "ssl", "ca-certificates",
    "ca-certificates.conf", "mime.types", "magic", "magic.mime", "os-release", "debian_version",
    "inputrc", "shells", "terminfo", "python3", "python3.*", "perl", "vim", "xml", "sgml",
    "java-*",
)
"""Host ``/etc`` entries (fnmatch patterns) bound read-only into the sandbox. Deliberately not
``shadow``, ``sudoers``, ``ssh``, ``pip.conf``, ``npmrc``, ``gitconfig`` (credentials live there)."""

@functools.lru_cache(maxsize=2)
def _etc_entries(allow_network: bool) -> tuple[str, ...]:
    """Host ``/etc`` entries matching :data:`ETC_ENTRIES` (plus resolv.conf with network); read
    once per process (bubblewrap start-up cost matters: episodes start often)."""
    patterns = ETC_ENTRIES + (("resolv.conf",) if allow_network else ())
    etc = Path("/etc")
    return tuple(entry for entry in sorted(os.listdir(etc))
                 if any(fnmatch.fnmatchcase(entry, p) for p in patterns) and (etc / entry).exists())


@functools.lru_cache(maxsize=1)
def _python_paths() -> list[Path]:
    """Host folders that make the running Python work inside the sandbox (outside ``/usr``)."""
    candidates = [Path(sys.base_prefix), Path(sys.prefix)]
    if sys.executable:
        candidates += [Path(sys.executable).parent, Path(os.path.realpath(sys.executable)).parent]
    paths: list[Path] = []
    for path in sorted({Path(os.path.realpath(p)) for p in candidates} | set(candidates), key=lambda p: len(p.parts)):
        if not path.is_absolute() or not path.exists() or path.is_relative_to("/usr"):
            continue
        if any(path.is_relative_to(kept) for kept in paths):
            continue
        paths.append(path)
    return paths


_LOCAL_AVAILABLE: list[bool] = []


def check_local_available() -> None:
    """Raise :class:`SandboxUnavailable` (one line: what to install or change) unless bubblewrap
    can create a sandbox here (a success is remembered for the process)."""
    if _LOCAL_AVAILABLE:
        return
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable("bubblewrap (bwrap) not found: install it with `apt-get install bubblewrap`")
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        raise SandboxUnavailable("setpriv not found (needed to drop root in the sandbox): install util-linux")
    probe = subprocess.run(
        ["bwrap", "--unshare-all", "--die-with-parent", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr",
         "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--", "/usr/bin/true"],
        capture_output=True, text=True, timeout=30,
    )
    if probe.returncode != 0:
        raise SandboxUnavailable(
            f"bubblewrap cannot create a sandbox here ({probe.stderr.strip() or probe.returncode}): "
            "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1) or run as root"
        )
    _LOCAL_AVAILABLE.append(True)


def _chown_tree(path: Path, uid: int, gid: int, recursive: bool = True) -> None:
    """chown ``path`` (and, if ``recursive``, everything under it) without following symlinks."""
    os.chown(path, uid, gid, follow_symlinks=False)
    if recursive and path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                os.chown(os.path.join(root, name), uid, gid, follow_symlinks=False)


def _read_tail(path: Path, limit: int) -> bytes:
    """A regular file's last ``limit`` bytes without following a final symlink (b"" if absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return b""
        if info.st_size > limit:
            os.lseek(fd, info.st_size - limit, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)[-limit:]
    finally:
        os.close(fd)
