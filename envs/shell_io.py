"""The wire protocol between a sandbox backend and its persistent shell, shared by backends.

Each command is sent as one line,
``eval $'<command>' </dev/null; printf '\\n%s%s %d\\n' <sentinel halves> "$?"``. The command is
quoted as an ANSI-C string (:func:`~t1async.envs.protocol.bash_quote`), so no command text (an
unclosed quote, a heredoc) can desynchronise the shell; its stdin is ``/dev/null``, so it cannot
eat the next command; the sentinel is random per sandbox and is printed from two halves, so a
``set -x``/``set -v`` echo of the line never contains it whole. Output is read with bounded memory
(:class:`OutputBuffer`: head and tail kept, the middle counted).
"""

from __future__ import annotations

import secrets

from .protocol import bash_quote


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
