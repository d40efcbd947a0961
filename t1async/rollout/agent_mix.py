"""Which agent drives each episode when ``rollout.agent`` is a weighted mix (``{builtin: 2, codex: 1}``).

Each rollout actor draws the agent of every episode it runs from the mix's weights, with a random
stream of its own seeded by ``run.seed`` and the actor's number: the same run seed gives each actor
the same sequence of agents (which episode of which task gets which one depends on admission order,
as the tasks themselves do). The drawn name travels in the trajectory (``Trajectory.agent``) and the
learner's metrics split by it (t1async/learner/metrics.py ``by_agent``).
"""

from __future__ import annotations

import random
from typing import Any

from t1async.config import agent_weights


class AgentMix:
    """The agents of ``rollout.agent`` and their weights, drawn per episode.

    Args:
        agent: ``rollout.agent``: one name, or a mapping of names to weights > 0 (validated by the config).
        seed: ``run.seed``.
        actor_id: the rollout actor's number (each actor has its own stream).

    Attributes:
        weights: ``{name: weight}`` as configured (a single name has weight 1).
    """

    def __init__(self, agent: Any, seed: int, actor_id: int):
        self.weights = agent_weights(agent)
        self._names = list(self.weights)
        self._rng = random.Random(f"t1async-agent-mix:{seed}:{actor_id}")  # (a str seed: the same in every process)

    @property
    def names(self) -> list[str]:
        """Every agent of the mix, in the configured order."""
        return list(self._names)

    def draw(self) -> str:
        """The agent of the next episode: name ``i`` with probability ``weight_i / sum(weights)``
        (a single agent is returned without using the random stream)."""
        if len(self._names) == 1:
            return self._names[0]
        return self._rng.choices(self._names, weights=list(self.weights.values()))[0]
