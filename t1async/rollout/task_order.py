"""The task order: which task each admitted episode runs, and how a resumed run continues it.

The controller (``t1async/actors/controller.py``) admits episodes in a shuffled round robin: a pass is
every task once, in an order drawn with ``random.Random(run.seed)``, each task repeated
``rollout.group_size`` times in a row (a group); the next pass is a fresh shuffle from the same
generator. :class:`TaskOrder` is that stream, and :meth:`TaskOrder.state` / :meth:`TaskOrder.restore`
carry its position across a restart.

Where the state lives, and which state it is: the learner asks the controller for
:meth:`TaskOrder.state` each time it writes a checkpoint and saves it beside the model state, as
``task_order.json`` (:func:`write_task_order`); a launch with ``learner.resume`` reads it from the
checkpoint the learner resumed from (:func:`read_task_order`) and starts its controller there.
The state is therefore the one of the checkpointed step: every episode that checkpoint trained was
drawn at or before the saved position. Tasks drawn after the checkpoint and before the kill are
drawn again by the resumed run (the stream continues from the checkpoint, not from the kill);
those of their episodes that reached the receive log or a rollout spool are trained as well, so
such a task gets one extra episode (or group) in that pass: never skipped, oversampled by at most
one checkpoint interval's draws. An episode that was running when the run died is lost like a
failed episode (its task is not drawn again). A group partially admitted at the checkpoint is
completed first by the resumed run (its remaining episodes head the restored stream). Without a
``task_order.json`` (a checkpoint written before it was saved, or no checkpoint: the learner
restarts from step 0) the order starts over from its head, as the model state does.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from loguru import logger

TASK_ORDER_FILE = "task_order.json"
FORMAT = 1


def _digest(tasks: list[str]) -> str:
    return hashlib.sha256("\n".join(tasks).encode()).hexdigest()


class TaskOrder:
    """The shuffled round robin of task names (see the module docstring).

    Args:
        tasks: task names (non-empty; their order matters: the same names in the same order give
            the same stream).
        group_size: episodes of each drawn task in a row (G >= 1).
        seed: seed of the generator the passes are shuffled with (``run.seed``).

    Raises:
        ValueError: no tasks, or ``group_size`` < 1.
    """

    def __init__(self, tasks: list[str], group_size: int = 1, seed: int = 0):
        if not tasks:
            raise ValueError("the task order needs at least one task")
        if group_size < 1:
            raise ValueError(f"rollout.group_size must be >= 1, got {group_size}")
        self.tasks, self.group_size = list(tasks), int(group_size)
        self._rng = random.Random(seed)
        self._pass_rng = self._rng.getstate()  # the state the current (or next) pass is dealt from
        self._left: list[str] = []  # the current pass's episodes still to draw, last first
        self.taken = 0  # episodes drawn from the current pass (0: none dealt yet)
        self.drawn = 0  # episodes drawn in all (every life of the run)
        self.passes = 0  # passes dealt in all

    def draw(self) -> str:
        """The next task name (a new pass is dealt when the current one is used up)."""
        if not self._left:
            self._deal()
        self.taken += 1
        self.drawn += 1
        return self._left.pop()

    def set_tasks(self, tasks: list[str]) -> None:
        """Draw from ``tasks`` from now on: the pass in progress is dropped, the next is dealt
        from the new names (a live change of ``env.tasks``).

        Raises:
            ValueError: ``tasks`` is empty.
        """
        if not tasks:
            raise ValueError("the task order needs at least one task")
        self.tasks, self._left, self.taken = list(tasks), [], 0
        self._pass_rng = self._rng.getstate()

    def state(self) -> dict[str, Any]:
        """A JSON-able snapshot of the stream's position: the generator state the current pass
        was dealt from (``pass_rng``), the episodes drawn from it (``pass_taken``), the totals
        (``drawn``, ``passes``), and which tasks and group size it was dealt with (``tasks``: a
        count, ``tasks_sha256``: their names' digest; ``group_size``). About 8 KB whatever the
        number of tasks: the pass itself is dealt again on :meth:`restore`."""
        version, internal, gauss = self._pass_rng
        return {"format": FORMAT, "tasks": len(self.tasks), "tasks_sha256": _digest(self.tasks),
                "group_size": self.group_size, "drawn": self.drawn, "passes": self.passes,
                "pass_taken": self.taken, "pass_rng": [version, list(internal), gauss]}

    def restore(self, state: dict[str, Any]) -> str | None:
        """Continue the stream ``state`` (from :meth:`state`) describes: the next :meth:`draw` is
        the one that would have followed it.

        Returns:
            None when the stream continues exactly; otherwise why it could not: the tasks or
            the group size differ from those ``state`` was dealt with, and the pass in progress is
            dropped (the next pass is dealt from the saved generator state, so the run still
            does not start over from the head).

        Raises:
            ValueError: ``state`` is not a task-order state of this format (names the field).
        """
        try:
            if state.get("format") != FORMAT:
                raise ValueError(f"format {state.get('format')!r}, expected {FORMAT}")
            version, internal, gauss = state["pass_rng"]
            rng_state = (int(version), tuple(int(x) for x in internal), gauss)
            taken, drawn, passes = int(state["pass_taken"]), int(state["drawn"]), int(state["passes"])
            same = state["tasks_sha256"] == _digest(self.tasks) and int(state["group_size"]) == self.group_size
            self._rng.setstate(rng_state)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a task-order state: {type(e).__name__}: {e}") from None
        self._pass_rng, self._left, self.taken = rng_state, [], 0
        self.drawn, self.passes = drawn, passes
        if not same:
            return (f"the tasks or rollout.group_size differ from those the saved order was dealt with "
                    f"({state['tasks']} tasks, group size {state['group_size']}; now {len(self.tasks)}, "
                    f"{self.group_size}): the pass in progress is dropped and a new one is dealt")
        if taken:
            self._deal()
            self.passes = passes  # (dealing again is no new pass)
            if taken > len(self._left):
                raise ValueError(f"not a task-order state: pass_taken {taken} > {len(self._left)} episodes in a pass")
            del self._left[len(self._left) - taken:]
            self.taken = taken
        return None

    @classmethod
    def continued(cls, tasks: list[str], group_size: int, seed: int, state: dict[str, Any] | None) -> "TaskOrder":
        """A new order continued from ``state`` (:meth:`restore`; None: from its head), logged;
        a state that cannot be continued is logged and the order starts over from its head (a
        resume is not refused over its task order)."""
        order = cls(tasks, group_size, seed)
        if state is None:
            return order
        try:
            note = order.restore(state)
        except ValueError as e:
            logger.error("the saved task order cannot be continued ({}): it starts over from its head", e)
            return cls(tasks, group_size, seed)
        logger.log("WARNING" if note else "INFO", "task order continued after episode {} (pass {}){}",
                   order.drawn, order.passes, f": {note}" if note else "")
        return order

    def _deal(self) -> None:
        self._pass_rng = self._rng.getstate()
        # popped from the end: each task's group_size episodes in a row
        self._left = [t for t in self._rng.sample(self.tasks, len(self.tasks)) for _ in range(self.group_size)]
        self.taken = 0
        self.passes += 1


def write_task_order(folder: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (:meth:`TaskOrder.state`) as ``folder/task_order.json`` (a checkpoint's
    staging folder: the checkpoint's atomic rename commits it with the model state)."""
    path = Path(folder) / TASK_ORDER_FILE
    path.write_text(json.dumps(state))
    return path


def read_task_order(checkpoint: Path | str | None) -> dict[str, Any] | None:
    """The task-order state saved in ``checkpoint`` (a ``step_N`` folder), or None when there is
    no checkpoint or it holds none (written before the task order was saved).

    Raises:
        ValueError: the file is not JSON (names it and says how to start the order over).
    """
    if checkpoint is None:
        return None
    path = Path(checkpoint) / TASK_ORDER_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable task order ({e}); delete it to start the task order over "
                         "from its head") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: a task order is a JSON object; delete it to start the task order over")
    return state
