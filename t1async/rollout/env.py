"""What an episode needs of a task and its sandboxed shell: the ``Env`` and ``TaskInfo`` protocols.

The episode loop (:mod:`t1async.rollout.episode`, :mod:`t1async.rollout.endpoint.agent`) is written against
these; ``t1async.envs.terminal.TerminalEnv`` and ``t1async.envs.taskio.task.Task`` satisfy them, and the
Ray role (``t1async/actors/rollout.py``) or a command wires the real ones in. Tests may pass any object
with these members.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class StepResult(Protocol):
    """One command's outcome in the sandbox."""

    output: str
    """What the agent is shown (stdout and stderr, possibly truncated)."""
    timed_out: bool
    """The command ran past its time limit and was killed."""
    refused: bool
    """A sandbox limit (processes, memory, files) refused or stopped it."""


class TestOutcome(Protocol):
    """One verifier test: its name and whether it passed."""

    name: str
    passed: bool


class Verdict(Protocol):
    """The verifier's judgement of an episode."""

    reward: float
    """The episode's dense reward (tests passed)."""
    passed: int
    total: int
    resolved: bool
    """Every test passed (and at least one ran)."""
    tests: Sequence[TestOutcome]
    error: str | None
    """Why the verifier itself failed (None: it ran)."""
    output: str
    """The verifier's output (kept for the log when ``error`` is set)."""


class Env(Protocol):
    """One task's sandboxed shell for one episode: ``reset``, then ``step`` per command, then ``verify``."""

    def reset(self) -> str:
        """Start a fresh sandbox with the task's workspace; returns the instruction to show the agent."""

    def step(self, command: str) -> StepResult:
        """Run one shell command in the sandbox."""

    def verify(self) -> Verdict:
        """Run the task's verifier on the sandbox's final state."""

    def run_agent(self, command: str, timeout_s: float) -> StepResult:
        """Run a named harness (t1async/rollout/harnesses.py) as one command in the sandbox's shell, with
        the episode's time budget: its own commands then reach the task's files."""

    def close(self) -> None:
        """Remove the sandbox.

        An Env whose sandbox does not see the host's files (``container``) may also have ``lends_host`` (True) and
        ``lend_host(mounts, ports)``, called before :meth:`reset` for a named harness (see
        ``t1async.envs.terminal.TerminalEnv.lend_host``); the episode code looks for them with ``getattr``."""


class TaskInfo(Protocol):
    """What the episode loop reads of a task."""

    name: str
    agent_timeout_s: float
    """The agent's time budget for one episode (seconds)."""
