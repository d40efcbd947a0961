"""The rollout actors a controller supervises: which run, which retire, which start next (bookkeeping only).

The controller role (t1async/actors/controller.py) starts, waits on and kills the actors through
Ray; this records them and decides, each tick, which retired actors can be stopped at once and how
many new ones to start (at most ``start_per_tick``, so a large scale-up is spread over ticks and a
scale-down or a stop meanwhile acts on few actors).
"""

from __future__ import annotations

import time
from typing import Any, Callable

START_PER_TICK = 4
"""Rollout actors the supervision loop starts per tick (about a second) at most."""


class RolloutFleet:
    """Rollout actors by id: their handle and ``run`` call, retirement, start time.

    Args:
        target: the number of actors wanted (``rollout.num_actors``; changed by ``scale``).
        start_per_tick: actors started per :meth:`plan` at most.

    Attributes:
        actors: actor id -> (handle, its ``run`` call's object ref).
        retired: ids past the target: each finishes its running episode, then is told to stop.
        started_at: actor id -> time.time() it was started.
    """

    def __init__(self, target: int, start_per_tick: int = START_PER_TICK):
        self.target, self.start_per_tick = target, start_per_tick
        self.actors: dict[int, tuple[Any, Any]] = {}
        self.retired: set[int] = set()
        self.started_at: dict[int, float] = {}
        self._next_id = 0

    def plan(self, never_admitted: Callable[[int], bool]) -> tuple[list[tuple[int, Any]], list[int]]:
        """Retire the actors past :attr:`target` (the lowest ids stay), then return (the id and
        handle of each retired actor never admitted an episode, removed here: the caller kills them
        at once; the ids of the actors to start now, at most ``start_per_tick``)."""
        live = sorted(a for a in self.actors if a not in self.retired)
        for aid in live[self.target:]:
            self.retired.add(aid)  # finishes its current episode, then acquire() says stop
        idle = [aid for aid in self.retired if aid in self.actors and never_admitted(aid)]
        kill = [(aid, self.remove(aid)) for aid in idle]  # it holds no episode and sent nothing of its own
        missing = min(self.target - min(len(live), self.target), self.start_per_tick)
        start = list(range(self._next_id, self._next_id + missing))
        self._next_id += missing
        return kill, start

    def add(self, actor_id: int, handle: Any, run_ref: Any) -> None:
        """Record a started actor."""
        self.actors[actor_id] = (handle, run_ref)
        self.started_at[actor_id] = time.time()

    def remove(self, actor_id: int) -> Any:
        """Forget an actor (its run ended, or it is killed); returns its handle (None if unknown)."""
        handle, _ = self.actors.pop(actor_id, (None, None))
        self.retired.discard(actor_id)
        self.started_at.pop(actor_id, None)
        return handle
