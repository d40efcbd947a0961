"""Memory pressure on the launch's node: Ray's memory monitor, and backing off before it strikes again.

Ray's raylet kills worker processes (any role: learner, controller, samplers, rollout actors,
several at once) when the node's memory use passes ``RAY_memory_usage_threshold`` (0.95 by
default; checked every ``RAY_memory_monitor_refresh_ms``, 250 ms). The service survives such a
kill as it survives ``kill -9``: the learner restarts from its last checkpoint and the receive
log, the controller and its rollout actors are started again (t1async/service/service.py), the
sampler pool restarts samplers, the rollout actors' spools are resent. Nothing is lost; what
remains is not to walk into the threshold again at once, which :class:`MemoryBackoff` does:
while memory stays short it lowers the rollout actors' target (halved per step, at least 1),
says so once on the console and in ``t1async status``, and once memory has been back below
the threshold with a margin for :attr:`MemoryBackoff.calm_s` it restores the operator's count.

"Short" means: node memory in use at or above ``threshold - margin``, or a role killed for
memory within the last ``calm_s`` seconds. Memory in use is ``1 - MemAvailable / MemTotal``
of ``/proc/meminfo`` (the figure Ray's monitor compares with its threshold on a node without a
cgroup limit).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from t1async.actors import killed_for_memory

DEFAULT_THRESHOLD = 0.95  # Ray's RAY_memory_usage_threshold default


def ray_memory_threshold(env: dict[str, str] | None = None) -> float:
    """Ray's kill threshold (fraction of the node's memory in use) for a Ray started from this
    process's environment (``RAY_memory_usage_threshold``, else 0.95)."""
    raw = (env if env is not None else os.environ).get("RAY_memory_usage_threshold", "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_THRESHOLD
    return value if 0 < value <= 1 else DEFAULT_THRESHOLD


def node_memory_used(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """Fraction of this node's memory in use, ``1 - MemAvailable / MemTotal``; None when unreadable."""
    try:
        fields = {line.split(":")[0]: int(line.split()[1]) for line in meminfo.read_text().splitlines()
                  if line.split(":")[0] in ("MemTotal", "MemAvailable")}
        return 1.0 - fields["MemAvailable"] / fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError, ZeroDivisionError):
        return None


class MemoryBackoff:
    """The rollout actors' target under memory pressure (see the module docstring).

    Args:
        threshold: Ray's kill threshold (:func:`ray_memory_threshold`).
        margin: memory counts as short from ``threshold - margin`` on; as back below
            ``threshold - 2 x margin``.
        calm_s: seconds memory must stay back (and no role killed for memory) before the
            operator's count is restored.

    Attributes:
        reduced_to: the rollout actors' target while backing off, None when not.
        memory_kills: roles killed for memory so far (:meth:`role_killed`).
        reason: why it backs off (for status), None when not.
        last_kill: the last role killed for memory, ``{"role", "step", "time"}`` (the learner's step
            then, wall-clock seconds), None before any: with the step now, status says that
            training resumed after it (:func:`memory_line`).
    """

    def __init__(self, threshold: float, margin: float = 0.03, calm_s: float = 60.0):
        self.threshold, self.margin, self.calm_s = threshold, margin, calm_s
        self.reduced_to: int | None = None
        self.memory_kills = 0
        self.reason: str | None = None
        self.last_kill: dict[str, object] | None = None
        self._kill_pending = False  # a kill not yet answered by a cut
        self._last_event = -1e18  # last time memory was short, a role was killed for memory, or a cut

    def role_killed(self, role: str, now: float | None = None, step: int | None = None) -> None:
        """``role`` died because Ray's memory monitor killed it (at learner step ``step``): the
        next :meth:`update` cuts."""
        self.memory_kills += 1
        self.last_kill = {"role": role, "step": step, "time": round(time.time(), 1)}
        self._kill_pending = True
        self._last_event = time.monotonic() if now is None else now
        self.reason = f"Ray's memory monitor killed the {role}"

    def update(self, used: float | None, target: int, now: float | None = None) -> tuple[int | None, str | None]:
        """Given node memory in use ``used`` (fraction, None: unknown) and the operator's rollout
        actor count ``target``: ``(the rollout actors' target to apply now or None, a console line
        or None)``. A kill cuts once; memory that stays short cuts again every ``calm_s / 4``
        seconds (a cut takes that long to show), down to 1."""
        now = time.monotonic() if now is None else now
        short = used is not None and used >= self.threshold - self.margin
        if short:
            self.reason = f"node memory {used:.0%} in use, Ray kills at {self.threshold:.0%}"
        current = self.reduced_to if self.reduced_to is not None else target
        due = self._kill_pending or (short and (self.reduced_to is None or now - self._last_event >= self.calm_s / 4))
        if due:
            self._kill_pending = False
            self._last_event = now
            lowered = max(1, current // 2)
            if lowered == self.reduced_to:
                return None, None
            self.reduced_to = lowered
            return lowered, (f"memory short ({self.reason}): rollout actors {current} -> {lowered} until memory in "
                             f"use stays below {self.threshold - 2 * self.margin:.0%} for {self.calm_s:.0f} s")
        if short:
            return None, None
        back = used is None or used < self.threshold - 2 * self.margin
        if not back:
            self._last_event = now  # (between the two marks: not calm)
        elif self.reduced_to is not None and now - self._last_event >= self.calm_s:
            self.reduced_to, self.reason = None, None
            return target, f"memory is back: rollout actors back to {target}"
        return None, None

    def status(self) -> dict[str, object]:
        """``{"short": bool, "reason", "rollout_actors_reduced_to", "memory_kills", "threshold",
        "last_kill"}`` for status."""
        return {"short": self.reduced_to is not None, "reason": self.reason, "rollout_actors_reduced_to": self.reduced_to,
                "memory_kills": self.memory_kills, "threshold": self.threshold, "last_kill": self.last_kill}


def memory_line(memory: dict | None, step: int | None, target: int | None = None) -> str:
    """``t1async status``'s memory row from :meth:`MemoryBackoff.status` (``memory``), the learner's
    step now and the operator's rollout actor count ``target``: the last role Ray's memory monitor
    killed, at which step, whether training resumed since (steps trained after it), and the back-off.

    """
    m = memory or {}
    threshold = m.get("threshold")
    if not m.get("memory_kills"):
        head = f"no role killed by Ray's memory monitor (threshold {threshold:.0%})" if threshold else "no role killed"
    else:
        last = m.get("last_kill") or {}
        at = last.get("step")
        since = (step - at) if isinstance(step, int) and isinstance(at, int) else None
        resumed = (f"training resumed ({since} steps since)" if since is not None and since > 0
                   else "no step trained since yet")  # (a learner back on an older checkpoint is below ``at``)
        head = (f"{m['memory_kills']} role(s) killed by Ray's memory monitor (threshold {threshold:.0%}): last the "
                f"{last.get('role', 'role')} at step {at if at is not None else '?'}, restarted; {resumed}")
    if m.get("short") and m.get("rollout_actors_reduced_to") is not None:
        head += f"; backing off: rollout actors {m['rollout_actors_reduced_to']}" + (f" of {target}" if target else "")
    return head


__all__ = ["MemoryBackoff", "killed_for_memory", "memory_line", "node_memory_used", "ray_memory_threshold"]
