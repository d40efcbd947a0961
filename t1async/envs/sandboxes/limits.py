"""Resource limits of the local sandbox: cgroup v1 controllers, size-capped tmpfs, rlimits.

Mechanisms, chosen per host at sandbox start (and reported by :meth:`LimitGroup.mechanisms`):

* **cgroup v1** (``/sys/fs/cgroup/{pids,memory,cpu}``, writable by root here): one child group
  per sandbox, created under the group this process is in (so a parent's limits still hold);
  ``pids.max`` caps processes and threads (fork bombs), ``memory.limit_in_bytes`` (and
  ``memsw``) caps memory including tmpfs pages the sandbox writes, ``cpu.cfs_quota_us`` caps the
  CPU share. The sandbox's first process joins them before it execs bubblewrap, so everything
  it starts is inside. Counters (``pids.events``, ``memory.failcnt``) say when a limit refused
  something, for the episode's record. The groups are removed at close.
* **tmpfs** of ``disk_mb`` mounted on the host over the workspace and logs folders (root only:
  ``mount(2)``), so a full disk is the sandbox's own tmpfs, never the host's disk.
* **rlimits**, set by the wrapper before bubblewrap starts, inherited by every process:
  RLIMIT_CPU (CPU seconds per process), RLIMIT_FSIZE (largest file), and without cgroups
  RLIMIT_AS (memory per process) and RLIMIT_NPROC (processes of the sandbox's uid; it does
  nothing for host uid 0, hence the uid switch in :mod:`t1async.envs.sandboxes.local`).

Why cgroup v1 and not v2: this machine mounts the v1 hierarchies (v2 is mounted but has no
controllers enabled). A host without writable cgroups falls back to rlimits only; the sandbox
still runs and :meth:`LimitGroup.mechanisms` says what holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import secrets
import shlex
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from ..protocol import SandboxLimits

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("pids", "memory", "cpu")
CPU_PERIOD_US = 100_000
MNT_DETACH = 2
MS_NOSUID, MS_NODEV = 2, 4


def _current_group(controller: str) -> str | None:
    """This process's group path in the v1 hierarchy of ``controller`` (None if not mounted)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return path
    return None


def cgroups_usable() -> dict[str, Path]:
    """The v1 controllers among :data:`CONTROLLERS` under which this process may create groups:
    {controller: folder of this process's group}."""
    usable = {}
    for controller in CONTROLLERS:
        path = _current_group(controller)
        if path is None:
            continue
        folder = CGROUP_ROOT / controller / path.lstrip("/")
        if folder.is_dir() and os.access(folder, os.W_OK):
            usable[controller] = folder
    return usable


_libc = None


def _mount_tmpfs(target: Path, size_mb: int, uid: int, gid: int) -> bool:
    """Mount a ``size_mb`` tmpfs owned by ``uid:gid`` on ``target``; False when not allowed."""
    global _libc
    if os.geteuid() != 0:
        return False
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    options = f"size={size_mb}m,mode=0755,uid={uid},gid={gid}".encode()
    if _libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
        err = ctypes.get_errno()
        logger.debug("tmpfs mount on {} failed: {}", target, os.strerror(err))
        return False
    return True


def _umount(target: Path) -> None:
    if _libc is not None and _libc.umount2(str(target).encode(), MNT_DETACH) != 0:
        logger.warning("could not unmount the sandbox tmpfs {}: {}", target, os.strerror(ctypes.get_errno()))


def _mount_points() -> list[Path]:
    """Mount points of this mount namespace (``/proc/self/mounts``, octal escapes decoded)."""
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 2:
            out.append(Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])))
    return out


def unmount_all_under(root: Path) -> int:
    """Detach every mount at or below ``root`` (deepest first); returns how many.

    For workspaces a dead process left mounted: a sandbox's disk tmpfs is mounted on the host
    (so the verifier and the actor see /app), and an actor killed with SIGKILL cannot unmount it;
    its files would hold memory and its folder could not be removed. Needs root, like the mount.
    """
    global _libc
    root = Path(os.path.realpath(root))
    found = sorted((m for m in _mount_points() if m == root or root in m.parents), key=lambda m: len(m.parts),
                   reverse=True)
    if not found:
        return 0
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for m in found:
        _umount(m)
    return len(found)


@dataclass
class LimitGroup:
    """The limits of one local sandbox: its cgroups, tmpfs mounts and the rlimit prefix.

    Args:
        limits: what to enforce.
        uid, gid: owner of the tmpfs mounts (the sandbox's user).
    """

    limits: SandboxLimits
    uid: int
    gid: int
    groups: dict[str, Path] = field(default_factory=dict)
    mounts: list[Path] = field(default_factory=list)
    _baseline: dict[str, int] = field(default_factory=dict)

    @classmethod
    def watch(cls, limits: SandboxLimits, groups: dict[str, Path]) -> LimitGroup:
        """A group over existing cgroup folders (a container's, made by its engine) whose
        refusal counters are read (:meth:`refusals`) but never created, joined or removed."""
        group = cls(limits, 0, 0, groups=dict(groups))
        group._baseline = group.counters()
        return group

    def create(self) -> None:
        """Create the cgroups (where usable) and write their limits. Never raises: a controller
        that cannot be set up is skipped with a debug log (rlimits then stand in)."""
        label = f"t1async-{os.getpid()}-{secrets.token_hex(4)}"
        wanted = {"pids": self.limits.max_processes, "memory": self.limits.memory_mb, "cpu": self.limits.cpus}
        for controller, parent in cgroups_usable().items():
            if not wanted[controller]:
                continue
            folder = parent / label
            try:
                folder.mkdir()
                if controller == "pids":
                    (folder / "pids.max").write_text(str(int(self.limits.max_processes)))
                elif controller == "memory":
                    limit = str(int(self.limits.memory_mb) << 20)
                    (folder / "memory.limit_in_bytes").write_text(limit)
                    try:  # memory + swap, so swapping cannot go around the limit
                        (folder / "memory.memsw.limit_in_bytes").write_text(limit)
                    except OSError:
                        pass
                else:
                    quota = max(1000, int(self.limits.cpus * CPU_PERIOD_US))
                    (folder / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                    (folder / "cpu.cfs_quota_us").write_text(str(quota))
            except OSError as exc:
                logger.debug("cgroup {} unusable: {}", folder, exc)
                try:
                    folder.rmdir()
                except OSError:
                    pass
                continue
            self.groups[controller] = folder
        self._baseline = self.counters()

    def mount_disk(self, folders: list[Path]) -> None:
        """Mount a ``disk_mb`` tmpfs over each (empty) folder, owned by the sandbox user; a
        folder that already holds files keeps them (they are moved into the tmpfs)."""
        if not self.limits.disk_mb:
            return
        for folder in folders:
            held = list(folder.iterdir())
            aside = None
            if held:
                aside = folder.with_name(folder.name + ".pre-" + secrets.token_hex(3))
                folder.rename(aside)
                folder.mkdir()
            if _mount_tmpfs(folder, int(self.limits.disk_mb), self.uid, self.gid):
                self.mounts.append(folder)
            if aside is not None:
                for entry in aside.iterdir():
                    shutil.move(str(entry), str(folder / entry.name))
                aside.rmdir()

    def wrapper(self) -> list[str]:
        """``sh -c`` argv prefix that joins the cgroups, sets umask 022 and the rlimits, and execs ``"$@"``."""
        lines = [f"echo $$ > {shlex.quote(str(folder / 'cgroup.procs'))}" for folder in self.groups.values()]
        lines.append("umask 022")  # as in Docker; bubblewrap also creates its mount points with it
        if self.limits.cpu_time_s:
            lines.append(f"ulimit -t {int(self.limits.cpu_time_s)}")
        if self.limits.max_file_mb:
            lines.append(f"ulimit -f {int(self.limits.max_file_mb) * 1024}")  # 1 KiB blocks in sh
        if "memory" not in self.groups and self.limits.memory_mb:
            lines.append(f"ulimit -v {int(self.limits.memory_mb) * 1024}")
        if "pids" not in self.groups and self.limits.max_processes and self.uid != 0:
            lines.append(f"ulimit -u {int(self.limits.max_processes)}")
        lines.append('exec "$@"')
        return ["/bin/sh", "-c", " && ".join(lines), "t1async-limits"]

    def mechanisms(self) -> dict[str, str]:
        """What enforces each limit here, e.g. {"processes": "cgroup pids", "disk": "tmpfs"}."""
        return {
            "processes": "cgroup pids" if "pids" in self.groups else ("RLIMIT_NPROC" if self.uid else "none (host uid 0)"),
            "memory": "cgroup memory" if "memory" in self.groups else "RLIMIT_AS",
            "cpu": "cgroup cpu quota" if "cpu" in self.groups else "none",
            "cpu_time": "RLIMIT_CPU",
            "file_size": "RLIMIT_FSIZE",
            "disk": "tmpfs" if self.mounts else "RLIMIT_FSIZE only",
        }

    def counters(self) -> dict[str, int]:
        """Monotonic counters of refusals: ``processes`` (forks refused at pids.max),
        ``memory`` (OOM kills in the group)."""
        out: dict[str, int] = {}
        if "pids" in self.groups:
            try:
                events = (self.groups["pids"] / "pids.events").read_text().split()
                out["processes"] = int(events[events.index("max") + 1])
            except (OSError, ValueError, IndexError):
                pass
        if "memory" in self.groups:
            try:
                fields = dict(line.split() for line in (self.groups["memory"] / "memory.oom_control").read_text().splitlines())
                out["memory"] = int(fields.get("oom_kill", "0"))
            except (OSError, ValueError):
                pass
        return out

    def refusals(self) -> list[str]:
        """Limits that refused something since the last call (and updates the baseline)."""
        now = self.counters()
        hit = [name for name, value in now.items() if value > self._baseline.get(name, 0)]
        self._baseline = now
        return hit

    def disk_full(self) -> bool:
        """Whether a sandbox tmpfs is (nearly) full: less than 64 KiB free."""
        for folder in self.mounts:
            try:
                stat = os.statvfs(folder)
            except OSError:
                continue
            if stat.f_bavail * stat.f_frsize < 64 * 1024:
                return True
        return False

    def release(self) -> None:
        """Unmount the tmpfs folders and remove the cgroups (after their processes died).
        Idempotent; never raises."""
        for folder in self.mounts:
            _umount(folder)
        self.mounts = []
        for controller, folder in list(self.groups.items()):
            deadline = time.monotonic() + 2.0
            while True:
                try:
                    folder.rmdir()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        logger.warning("cgroup {} still busy; left behind", folder)
                        break
                    _kill_all(folder / "cgroup.procs")
                    time.sleep(0.01)
            del self.groups[controller]


def _kill_all(procs_file: Path) -> None:
    try:
        pids = [int(p) for p in procs_file.read_text().split()]
    except (OSError, ValueError):
        return
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
