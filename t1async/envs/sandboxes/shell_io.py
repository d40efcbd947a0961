"""The wire protocol between a sandbox backend and its persistent shell, shared by backends.

Each command is sent as one line,
``eval $'<command>' </dev/null; printf '\\n%s%s %d\\n' <sentinel halves> "$?"``. The command is
quoted as an ANSI-C string (:func:`~t1async.envs.protocol.bash_quote`), so no command text (an
unclosed quote, a heredoc) can desynchronise the shell; its stdin is ``/dev/null``, so it cannot
eat the next command; the sentinel is random per sandbox and is printed from two halves, so a
``set -x``/``set -v`` echo of the line never contains it whole. Output is read with bounded memory
(:class:`OutputBuffer`: head and tail kept, the middle counted).

Backends that drive the shell through pipes (``local``, ``container``) use :func:`write_all` and
:func:`read_to_marker`; backends that reach inside with a separate process per call (``modal``,
``container``) use :data:`KILL_SCRIPT`, :func:`clear_command` and :func:`read_command`.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import subprocess
import time
from typing import Callable

from ..protocol import bash_quote

TIMEOUT = "timeout"
"""Status of a write or read that reached its deadline."""
EOF = "eof"
"""Status of a write or read that found the shell's pipe closed."""

KILL_SCRIPT = r"""
shell=$1; me=$$; keep=" 1 $shell $me "
p=$PPID; while [ "$p" -gt 1 ] 2>/dev/null; do keep="$keep$p "; p=$(awk '{print $4}' /proc/$p/stat 2>/dev/null || echo 1); done
n=0
for i in 1 2 3 4 5; do
  for d in /proc/[0-9]*; do pid=${d#/proc/}
    case "$keep" in *" $pid "*) continue;; esac
    [ "$pid" -gt "$shell" ] && kill -9 "$pid" 2>/dev/null && n=$((n+1))
  done
done
echo "$n"
"""
"""``bash -c KILL_SCRIPT kill SHELL_PID``, run as a separate process inside a container: SIGKILLs
every process that is neither pid 1, the shell, the killer nor one of its parents, and was started
after the shell (a higher pid: the commands' children, ``setsid`` and double-forked daemons
alike), five sweeps; prints how many it killed. Assumes pids are not recycled below the shell's
within one episode (a container's pid namespace counts up from 1)."""


def clear_command(path: str) -> str:
    """Shell text that empties (and creates) the folder ``path``; a symlink in its place is removed."""
    quoted = bash_quote(path)
    return f"rm -rf {quoted} && mkdir -p {quoted}"


def read_command(path: str, max_bytes: int) -> str:
    """Shell text that prints the last ``max_bytes`` of the regular file ``path`` (nothing when it
    is missing, not a regular file, or a symlink)."""
    quoted = bash_quote(path)
    return f"[ -f {quoted} ] && [ ! -L {quoted} ] && tail -c {int(max_bytes)} {quoted}"


def kill_repeatedly(victims: Callable[[], list[int]], grace_s: float) -> int:
    """SIGKILL the host pids ``victims()`` returns, again and again until it returns none or
    ``grace_s`` seconds passed (so fast forkers are caught); how many distinct pids were killed."""
    killed: set[int] = set()
    stop_at = time.monotonic() + grace_s
    while time.monotonic() < stop_at:
        pids = victims()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return len(killed)


def process_status(pid: int | str) -> dict[str, str] | None:
    """The fields of ``/proc/PID/status`` of a live process (None when gone or a zombie)."""
    try:
        text = open(f"/proc/{pid}/status").read()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return None if fields.get("State", "").strip().startswith(("Z", "X")) else fields


def close_pipes(proc: subprocess.Popen) -> None:
    """Close a shell process's stdin and stdout pipes (errors ignored)."""
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass


def write_all(fd: int, data: bytes, deadline: float) -> str | None:
    """Write ``data`` to the pipe ``fd`` by ``deadline`` (``time.monotonic()``); returns
    :data:`EOF` or :data:`TIMEOUT` on failure, else None."""
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return TIMEOUT
        _, ready, _ = select.select([], [fd], [], remaining)
        if not ready:
            continue
        try:
            written = os.write(fd, view[: select.PIPE_BUF])
        except OSError:  # BrokenPipeError included
            return EOF
        view = view[written:]
    return None


def read_to_marker(fd: int, buf: OutputBuffer, deadline: float) -> int | str:
    """Read the pipe ``fd`` into ``buf`` until its marker line (returns the command's exit status),
    end of file (:data:`EOF`) or ``deadline`` (:data:`TIMEOUT`)."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return TIMEOUT
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            return TIMEOUT
        chunk = os.read(fd, 65536)
        if not chunk:
            return EOF
        status = buf.feed(chunk)
        if status is not None:
            return status


class Sentinel:
    """A random end-of-command marker and the command line that prints it."""

    def __init__(self) -> None:
        token = secrets.token_hex(8)
        self.halves = (f"__T1_{token[:8]}", f"{token[8:]}__")
        self.marker = ("".join(self.halves) + " ").encode()

    def line(self, command: str) -> bytes:
        """The one line that runs ``command`` and then prints the marker and its status."""
        return (
            f"eval {bash_quote(command)} </dev/null; "
            f"printf '\\n%s%s %d\\n' {self.halves[0]} {self.halves[1]} \"$?\"\n"
        ).encode()


class OutputBuffer:
    """Bounded reader state: keeps the first ``head_cap`` and the last ``tail_cap`` bytes of a
    stream that ends with ``marker``; counts dropped bytes. Memory is O(caps + chunk)."""

    def __init__(self, max_bytes: int, marker: bytes):
        self.head_cap = max_bytes // 2
        self.tail_cap = max_bytes - self.head_cap
        self.max_bytes = max_bytes
        self.marker = marker
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self._search_from = 0

    def feed(self, chunk: bytes) -> int | None:
        """Add ``chunk``; return the exit status once the marker line is complete, else None."""
        self.tail += chunk
        idx = self.tail.find(self.marker, self._search_from)
        if idx >= 0:
            end = self.tail.find(b"\n", idx + len(self.marker))
            if end < 0:
                self._search_from = idx
                return None
            status = int(self.tail[idx + len(self.marker) : end].strip() or b"1")
            rest = bytes(self.tail[end + 1 :])
            del self.tail[idx:]
            if self.tail.endswith(b"\n"):  # the newline printed before the sentinel
                del self.tail[-1:]
            if rest:  # a background job wrote after the sentinel: keep it for the record
                self.tail += rest
            return status
        keep = self.tail_cap + len(self.marker) + 32
        if len(self.tail) > keep:
            overflow = len(self.tail) - keep
            room = max(0, self.head_cap - len(self.head))
            self.head += self.tail[: min(room, overflow)]
            self.dropped += overflow - min(room, overflow)
            del self.tail[:overflow]
        self._search_from = max(0, len(self.tail) - len(self.marker) - 32)
        return None

    def result(self) -> tuple[str, bool]:
        """The collected output (decoded, truncated with a marker) and whether it was truncated."""
        data = bytes(self.head + self.tail)
        if self.dropped == 0 and len(data) <= self.max_bytes:
            return data.decode("utf-8", errors="replace"), False
        head = bytes(self.head[: self.head_cap])
        rest = bytes(self.head[self.head_cap :] + self.tail)
        tail = rest[len(rest) - self.tail_cap :] if self.tail_cap else b""
        dropped = self.dropped + len(rest) - len(tail)
        text = (
            head.decode("utf-8", errors="replace")
            + f"\n[... truncated {dropped} bytes ...]\n"
            + tail.decode("utf-8", errors="replace")
        )
        return text, True
