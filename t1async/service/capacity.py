"""How many rollout actors and embedded samplers the Ray cluster can hold: the bound on
``rollout.num_actors`` and ``sampler.num_samplers`` at launch, on a resume and for ``t1async scale``.

Why: ``t1async scale RUN rollout.num_actors=10000`` (a typo of 300 would do) was accepted, and in
40 s the controller created 765 actors: Ray spawned a worker process per actor, the load went from
17 to 173 and free memory from 13 GB to 668 MB; the count stayed in config_history.jsonl, so the
resume flooded the node again. Actors take no Ray CPU reservation (``num_cpus=0``: on a 2-core
machine every role shares the cores), so Ray itself never refuses one.

The bound, for a cluster of ``cpus`` CPUs and ``memory_mb`` MB (Ray's ``CPU`` and ``memory``
resources, or ``ray.memory_mb``), with ``m[role]`` = ``ray.role_memory_mb`` (each role's
memory, measured by ``t1async bench role-memory``)::

    rollout actors <= min(cpus x ray.rollouts_per_cpu,
                          (memory_mb - m[learner] - m[controller] - samplers x m[sampler]) / m[rollout])
    samplers       <= min(cpus,
                          (memory_mb - m[learner] - m[controller] - actors x m[rollout]) / m[sampler])

and at least 1 each (a service needs one of each; a cluster too small for that fails as it would
have). A rollout actor mostly waits (for its sampler, its sandbox's commands), hence several per
CPU; a sampler computes, hence one per CPU.

Where it applies: a launch (new or resumed: a count in config_history.jsonl included) clamps a
count past the bound to it, with one warning line; ``t1async scale`` refuses it in one line
unless ``--force`` (the operator knows better, e.g. actors waiting on remote sandboxes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from t1async.config import RayConfig


@dataclass(frozen=True)
class Capacity:
    """What the bound counts on.

    Attributes:
        cpus: the cluster's CPUs (Ray's ``CPU`` resource).
        memory_mb: memory the roles may take, MB (``ray.memory_mb``, else Ray's ``memory`` resource).
        role_memory_mb: ``ray.role_memory_mb`` (role -> MB per actor of that role).
        rollouts_per_cpu: ``ray.rollouts_per_cpu``.
    """

    cpus: float
    memory_mb: float
    role_memory_mb: dict[str, int]
    rollouts_per_cpu: int

    def _free_mb(self, other_mb: float) -> float:
        m = self.role_memory_mb
        return self.memory_mb - m.get("learner", 0) - m.get("controller", 0) - other_mb

    def max_rollout_actors(self, num_samplers: int) -> int:
        """Most rollout actors beside ``num_samplers`` embedded samplers (>= 1); see the module docstring."""
        by_cpu = math.floor(self.cpus * self.rollouts_per_cpu)
        by_memory = math.floor(self._free_mb(num_samplers * self.role_memory_mb["sampler"])
                               / self.role_memory_mb["rollout"])
        return max(1, min(by_cpu, by_memory))

    def max_samplers(self, num_actors: int) -> int:
        """Most embedded samplers beside ``num_actors`` rollout actors (>= 1); see the module docstring."""
        by_cpu = math.floor(self.cpus)
        by_memory = math.floor(self._free_mb(num_actors * self.role_memory_mb["rollout"])
                               / self.role_memory_mb["sampler"])
        return max(1, min(by_cpu, by_memory))

    def describe(self) -> str:
        """``2 CPUs, 15,000 MB`` (for the one-line refusals)."""
        return f"{self.cpus:g} CPUs, {self.memory_mb:,.0f} MB"


def cluster_capacity(ray_cfg: RayConfig, resources: dict[str, float]) -> Capacity:
    """The :class:`Capacity` of a cluster whose ``ray.cluster_resources()`` are ``resources``
    (``CPU``; ``memory`` in bytes), ``ray.memory_mb`` replacing Ray's memory when set."""
    memory_mb = ray_cfg.memory_mb if ray_cfg.memory_mb else resources.get("memory", 0.0) / 2**20
    return Capacity(cpus=float(resources.get("CPU", 1.0)), memory_mb=float(memory_mb),
                    role_memory_mb=dict(ray_cfg.role_memory_mb), rollouts_per_cpu=ray_cfg.rollouts_per_cpu)


def scale_refusal(cap: Capacity, num_actors: int, num_samplers: int, changes: dict[str, Any]) -> str | None:
    """Why ``t1async scale`` refuses ``changes`` (the counts after them: ``num_actors`` rollout
    actors, ``num_samplers`` embedded samplers) on a cluster of ``cap``; None when they fit or
    neither count changes."""
    if "rollout.num_actors" in changes and num_actors > (most := cap.max_rollout_actors(num_samplers)):
        key, value, unit = "rollout.num_actors", num_actors, f"{cap.role_memory_mb['rollout']} MB and 1/" \
                                                            f"{cap.rollouts_per_cpu} CPU per rollout actor"
    elif "sampler.num_samplers" in changes and num_samplers > (most := cap.max_samplers(num_actors)):
        key, value, unit = "sampler.num_samplers", num_samplers, f"{cap.role_memory_mb['sampler']} MB and 1 CPU " \
                                                                 "per sampler"
    else:
        return None
    return (f"scale: {key}={value} is more than this Ray cluster can hold: at most {most} ({cap.describe()}; "
            f"{unit}: ray.role_memory_mb, ray.rollouts_per_cpu); add --force to scale past it")


def clamp_counts(cap: Capacity, num_actors: int, num_samplers: int) -> tuple[int, int, list[str]]:
    """The launch's counts within the bound: ``(num_actors, num_samplers, notes)``, one note per
    count lowered (samplers first: rollout actors are bounded beside the samplers kept)."""
    notes = []
    samplers = min(num_samplers, cap.max_samplers(1))
    if samplers < num_samplers:
        notes.append(f"sampler.num_samplers={num_samplers} lowered to {samplers}, what this Ray cluster can hold "
                     f"({cap.describe()}; {cap.role_memory_mb['sampler']} MB and 1 CPU per sampler)")
    actors = min(num_actors, cap.max_rollout_actors(samplers))
    if actors < num_actors:
        notes.append(f"rollout.num_actors={num_actors} lowered to {actors}, what this Ray cluster can hold "
                     f"({cap.describe()}; {cap.role_memory_mb['rollout']} MB and 1/{cap.rollouts_per_cpu} CPU per "
                     "rollout actor); raise ray.memory_mb or ray.rollouts_per_cpu if it can hold more")
    return actors, samplers, notes
