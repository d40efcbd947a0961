"""The reaper: a small process that cleans up after a launch process killed with SIGKILL.

``launch`` starts it (:meth:`Reaper.start`) in a session of its own (so a signal to the launch's
process group does not reach it). Every :data:`SCAN_S` seconds it records the launch process's
descendants (pid and start time: Ray's GCS, raylet, agents and workers, the sandboxes) from
``/proc``. It reads its stdin, a pipe from the launch process:

- ``done`` then end of file: the launch exited cleanly (it shut Ray down itself); the reaper exits.
- end of file alone: the launch process died (kill -9, a crash of the interpreter). The reaper
  kills every recorded descendant still alive (the same pid with the same start time, never a
  reused pid), detaches the sandbox tmpfs mounts under ``RUN_DIR/workspaces`` and removes it,
  and removes the session folder of a Ray the launch started (``service.json``: ``ray_session``).

Measured here: after ``kill -9`` of a launch, Ray's GCS and raylet exit on their own, but its
dashboard and runtime-env agents stay (reparented to init), and sandbox mounts stay until detached.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from t1async.envs.container import remove_orphan_containers
from t1async.envs.limits import unmount_all_under

SCAN_S = 1.0


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """``{pid: start time}`` of every live descendant of ``root`` (children, their children...)."""
    parent: dict[int, int] = {}
    start: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _proc_stat(int(entry))) is not None:
            parent[int(entry)], start[int(entry)] = st
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in found:
                found[child] = start[child]
                frontier.append(child)
    return found


def kill_sandboxes_under(work: Path) -> int:
    """SIGKILL every process whose command line names a path under ``work`` (the sandboxes of this
    run's workspaces: bwrap is given its binds there); they may have outlived their rollout actor,
    reparented to init, where no process tree leads to them. Returns how many were killed."""
    needle = str(work).encode() + b"/"
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
        except OSError:
            continue
    return killed


def reap(recorded: dict[int, int], run_dir: Path) -> int:
    """Kill the recorded processes still alive (same pid and start time), detach and remove the
    workspaces; returns how many processes were killed."""
    # Stop every recorded process still alive (same start time) and add what they started since
    # the last scan (a sandbox begun in the last second), until no new process turns up; then kill
    # them all. Stopped processes cannot fork, and their subtrees stay intact until the kill.
    alive = {pid: t for pid, t in recorded.items() if (st := _proc_stat(pid)) is not None and st[1] == t}
    for _ in range(20):
        for pid in alive:
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
        found = {c: t for pid in list(alive) for c, t in descendants(pid).items() if c != os.getpid()}
        new = {c: t for c, t in found.items() if c not in alive}
        if not new:
            break
        alive.update(new)
    killed = 0
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    work = run_dir / "workspaces"
    killed += kill_sandboxes_under(work)
    remove_orphan_containers(work)  # containers outlive their killed owners (the rollout actors)
    if work.exists():
        time.sleep(0.5)  # let the killed sandboxes release their mounts
        unmount_all_under(work)
        shutil.rmtree(work, ignore_errors=True)
    session = _local_ray_session(run_dir)
    if session is not None:  # the Ray this launch started leaves no folder in the system temp directory
        shutil.rmtree(session, ignore_errors=True)
    return killed


def _local_ray_session(run_dir: Path) -> Path | None:
    """The session folder of the Ray the dead launch started itself (``service.json``: ``ray_local``)."""
    try:
        info = json.loads((run_dir / "service.json").read_text())
    except (OSError, ValueError):
        return None
    session = info.get("ray_session") if info.get("ray_local") else None
    return Path(session) if session and Path(session).name.startswith("session_") else None


def main(argv: list[str]) -> int:
    """``python -m t1async.service.reaper LAUNCH_PID RUN_DIR`` (stdin: the pipe from the launch)."""
    launch_pid, run_dir = int(argv[0]), Path(argv[1])
    recorded: dict[int, int] = {}
    lines: list[str] = []
    eof = threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            lines.append(line.strip())
        eof.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    while not eof.wait(SCAN_S):
        recorded.update(descendants(launch_pid))
        recorded.pop(os.getpid(), None)  # (the reaper is a child of the launch too)
    if "done" in lines:
        return 0
    killed = reap(recorded, run_dir)
    with open(run_dir / "logs" / "reaper.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} launch pid {launch_pid} died; killed {killed} of its "
                f"{len(recorded)} recorded processes, removed {run_dir / 'workspaces'}\n")
    return 0


class Reaper:
    """The launch process's handle on its reaper."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    def start(cls, run_dir: Path) -> Reaper:
        """Start the reaper of this process, in its own session, logging to ``RUN_DIR/logs``."""
        proc = subprocess.Popen([sys.executable, "-m", "t1async.service.reaper", str(os.getpid()), str(run_dir)],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, text=True)
        return cls(proc)

    def done(self) -> None:
        """A clean exit: the reaper leaves everything alone and exits."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write("done\n")
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
