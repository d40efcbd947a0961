"""Admission rules (``rollout.admission``): when may a rollout start, and when may the learner publish.

Pure functions of the counts the controller keeps (t1async/rollout/admission_ledger.py holds them, the
controller role the lock; these hold the rules). Every rule keeps each trajectory trained within ``max_staleness``
(eta) versions; the default, ``learner_wait``, is described last, after the two it combines.

``oldest_episode`` is AReaL's formula measured from the oldest unfinished episode: a rollout may start only while

    started_rollouts < (oldest_version + max_staleness + 1) * rollouts_per_version

where ``rollouts_per_version`` = batch size x steps per published version and ``oldest_version``
is the smaller of the learner's version and the admission version of every episode admitted and
not yet consumed by the learner (running, or finished and on its way). AReaL uses the learner's
version there; with it, a long episode (a slow verifier, many turns) is overtaken: the learner
trains on the fast episodes admitted after it, publishes past its bound, and drops it as stale,
so slow tasks are trained on less than they are started (``t1async bench admission`` measures by
how much). Measuring from the oldest unfinished episode is the stale-synchronous-parallel rule
(Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous Parallel Parameter
Server"): the fastest may run at most ``max_staleness`` versions ahead of the slowest. It
guarantees the bound without drops: an episode admitted at version v is one of at most
(v + eta + 1) x R trajectories, so the learner (which needs (v + eta + 1) x R trajectories to
publish version v + eta + 1) must train it while its version is at most v + eta. Slow episodes
cost throughput (admission waits for them), never representation. The learner's staleness drop
remains as the last resort (a resumed run: an episode older than this controller; under
``learner_wait``, a hold past ``learner.batch_timeout_s``).

``max_staleness`` 0 is synchronous RL with these same roles: the ``rollouts_per_version``
episodes of version v all start on v's weights, the learner waits for all of them, and no
episode starts until it has trained them and published v + 1 (every trajectory trains at
staleness 0; ``t1async bench async`` runs it as the sync baseline). ``learner_version`` is
AReaL's rule (for comparison: it lets the fast run ahead of a slow episode and drops the latter
when it is too stale). ``learner_wait`` admits by the learner's version too, but moves the wait
from the actors to the learner: before each publish the learner asks the controller
(:func:`publish_allowed`), which refuses while an episode it does not hold yet would become too
stale, and it trains the oldest trajectories first. The bound and the no-drop guarantee hold as
under ``oldest_episode``, while the actors keep sampling (up to the bound ahead of the learner)
during a slow episode instead of waiting with it (``t1async bench async`` compares the three
rules' throughput and drops).

A new rule is one :class:`AdmissionRule` in :data:`ADMISSION_RULES` (and its name in the
``Admission`` choice of ``rollout.admission``, t1async/config/rollout.py; ``tests/unit/rollout/test_controller.py``
checks that the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable


def learner_version(version: int, unconsumed: Iterable[int]) -> int:
    """The version admission counts from: the learner's own (AReaL's rule)."""
    return version


def oldest_unconsumed(version: int, unconsumed: Iterable[int]) -> int:
    """The version admission counts from: the smaller of the learner's version and the admission
    version of every episode admitted and not yet consumed (running, or finished and on its way)."""
    return min([version, *unconsumed])


@dataclass(frozen=True)
class AdmissionRule:
    """One ``rollout.admission`` value."""

    base_version: Callable[[int, Iterable[int]], int]
    """``(learner version, admission versions of the episodes not yet consumed) -> version``
    that :func:`may_start` counts the window from."""
    holds_publish: bool
    """The learner asks :func:`publish_allowed` before each publish (the rule moves the wait for
    a slow episode from the actors to the learner)."""


ADMISSION_RULES: dict[str, AdmissionRule] = {
    "oldest_episode": AdmissionRule(oldest_unconsumed, holds_publish=False),
    "learner_version": AdmissionRule(learner_version, holds_publish=False),
    "learner_wait": AdmissionRule(learner_version, holds_publish=True),
}


def may_start(started: int, base_version: int, max_staleness: int, rollouts_per_version: int) -> bool:
    """Whether one more rollout may start: ``started < (base_version + max_staleness + 1) x
    rollouts_per_version`` (``started``: rollouts admitted so far, less those whose slot came back)."""
    return started < (base_version + max_staleness + 1) * rollouts_per_version


def resumed_admissions(trained: int, to_replay: int) -> int:
    """The ``started`` count a controller that starts on a resumed run begins with: every
    trajectory the run's learner has trained (its checkpoint's ``trained`` counter) plus those its
    receive log holds and it will train again (``to_replay``).

    Why: :func:`may_start` bounds ``started`` by ``(version + max_staleness + 1) x
    rollouts_per_version``, which holds only when ``started`` counts every rollout of the run since
    version 0. A controller started by a resumed launch (a new process) counted from 0 while the
    learner resumed at timeline version v: it admitted ``(v + max_staleness + 1) x
    rollouts_per_version`` episodes at once, all at version v, while the learner re-trained its
    backlog; they were then trained too stale or dropped (measured: 98 of 288 trajectories dropped
    as ``dropped_stale_restart`` in one resumed run). Counting what the learner trained and will
    train restores the bound: the new controller admits ``max_staleness + 1`` versions' worth past
    the learner's position. Under-counting only widens the window; trajectories still in the
    actors' spools are left out on purpose (some are in the receive log too), since an over-count
    would shrink every later window and with ``max_staleness`` 0 could leave the learner waiting
    for a batch admission never allows."""
    return max(0, int(trained)) + max(0, int(to_replay))


def publish_allowed(next_version: int, not_held: Iterable[int], max_staleness: int) -> bool:
    """Whether the learner may publish ``next_version`` under a rule that :attr:`AdmissionRule.holds_publish`:
    False while an episode the learner does not hold yet (running, or finished and on its way;
    ``not_held`` are their admission versions) was admitted at a version ``a`` with
    ``next_version - a > max_staleness``: publishing would make it too stale to train."""
    versions = list(not_held)
    return not versions or next_version - min(versions) <= max_staleness
