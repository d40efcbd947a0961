"""Timeline versions: staleness measured along the training timeline that survives learner restarts.

A weight version (the number a sampler reports and every sampled token carries) names one set of
published weights, and version numbers never repeat. A learner killed at step s restarts from its
last checkpoint, step c <= s, whose version v_c may be several publications behind the last one
it made (v_pub): the weights of v_c + 1 .. v_pub died with it. The resumed learner publishes its
weights under a new number, v_pub + 1, though they are v_c's weights (plus at most
``publish_every - 1`` updates), and then trains again, from the receive log, the trajectories of
the steps it lost. Measured in version numbers, that backlog and every episode in flight are
suddenly ``v_pub + 1 - v_c`` versions staler than they were, and the re-training pushes the number
further: a 3-minute soak with two learner kills dropped a quarter of its trajectories as stale.

The timeline version of a weight version is its position along the training timeline: the
number of regular publications (one per ``learner.publish_every`` steps) between the run's first
weights and those weights. In a run that never resumed it equals the weight version. A resumed
learner starts at its checkpoint's timeline version (the publication it resumes from) and
re-counts from there: its first publication (the same weights as the checkpoint's) keeps the
checkpoint's timeline version, and each ``publish_every`` steps advance it by one, as in the life
it replaces. The learner measures staleness, orders held trajectories and drives admission
(:mod:`t1async.rollout.admission`, t1async/actors/controller.py) in timeline versions; weight versions
stay unique names of weights (sampler replies, intake checks, metrics ``version``).

Why this keeps the staleness bound's meaning. The bound exists to bound the variance of the
importance weights pi_prox / mu: it limits how many updates separate the behaviour policy mu
(the weights that sampled) from the proximal policy pi_prox (the learner's weights when it trains
them); the weights themselves stay exact, the behaviour log-probs travel in the trajectory.
A trajectory trained at timeline staleness s <= eta was sampled by weights at most
(s + 1) x ``publish_every`` - 1 updates behind the learner's, as without restarts:

- weights published at a regular publication of timeline version t are the result of t x P
  updates along the timeline (P = ``publish_every``), and the learner at timeline version t has
  made at most t x P + P - 1;
- a resume's (or a joining sampler's) extra publication carries weights at most P - 1 updates
  past the timeline version it is given, so it is counted at most as fresh as it is (staleness
  is over-counted, never under-counted);
- weights of a lost life (v_c + 1 .. v_pub) sit at their own timeline positions on a branch that
  forks at the checkpoint: the resumed learner re-trains, from the same checkpoint, the same
  trajectories (the receive log's backlog, in the order received), so it reaches each of those
  positions again after as many updates as the lost life did. A trajectory sampled there is
  trained as stale as it would have been had the learner not died; one whose weights are ahead
  of the learner's timeline counts as staleness 0.

The mapping from weight version to timeline version is a list of starts ``(first weight version,
its timeline version)``, each valid up to the next start (the versions of one learner life count
up one by one with its timeline). A learner adds a start only when a publication would break
that (a resume's first publication, a joining sampler's extra one); it is written to
``RUN_DIR/receive_log/timeline.json`` before that publication is broadcast (as
``published_version`` is), so every weight version that ever reached a sampler can be mapped by
every later life, whichever checkpoint it resumes from. Without the file (a run that never
resumed) the mapping is the identity.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

import numpy as np

from t1async.fileio import replace_file
from t1async.trajectory import Trajectory

TIMELINE_FILE = "timeline.json"


class VersionTimeline:
    """Maps weight versions to timeline versions (see the module docstring).

    Args:
        starts: ``(first weight version, its timeline version)`` pairs, first versions strictly
            increasing; weight version v maps to ``tl + (v - first)`` of the last start with
            ``first <= v``, or to v itself below the first start.

    Raises:
        ValueError: first versions not strictly increasing, or a negative version in ``starts``.
    """

    def __init__(self, starts: list[tuple[int, int]] | None = None):
        self.starts = [(int(v), int(t)) for v, t in (starts or [])]
        firsts = [v for v, _ in self.starts]
        if any(b <= a for a, b in zip(firsts, firsts[1:])) or any(v < 0 or t < 0 for v, t in self.starts):
            raise ValueError(f"timeline starts {self.starts} must have strictly increasing, non-negative versions")
        self._firsts = firsts

    def at(self, version: int) -> int:
        """Timeline version of weight ``version`` (-1, no sampled token, stays -1)."""
        if version < 0:
            return version
        i = bisect.bisect_right(self._firsts, version) - 1
        if i < 0:
            return version
        first, tl = self.starts[i]
        return tl + version - first

    def oldest(self, versions: np.ndarray) -> int:
        """Smallest timeline version among weight versions ``versions`` (any shape, int; the
        sampled tokens' versions of a trajectory); -1 when empty. Not simply ``at(min)``: the
        first publication of a resumed life has a higher weight version and a lower timeline
        version than the lost life's last ones."""
        if versions.size == 0:
            return -1
        if not self.starts:
            return int(versions.min())
        return min(self.at(int(v)) for v in np.unique(versions))

    def rebase(self, version: int, timeline_version: int) -> None:
        """From weight ``version`` on, count up from ``timeline_version``.

        Raises:
            ValueError: ``version`` is not above every start (weight versions only grow).
        """
        if self._firsts and version <= self._firsts[-1]:
            raise ValueError(f"weight version {version} is not after the last timeline start {self.starts[-1]}")
        self.starts.append((int(version), int(timeline_version)))
        self._firsts.append(int(version))

    def save(self, path: Path, *, fsync: bool) -> None:
        """Write the starts to ``path`` atomically (a temporary file renamed into place; fsynced
        first with ``fsync``)."""
        replace_file(path, json.dumps({"starts": self.starts}), fsync=fsync)

    @classmethod
    def load(cls, path: Path) -> VersionTimeline:
        """The timeline written by :meth:`save`; the identity when ``path`` does not exist.

        Raises:
            ValueError: the file is not a timeline (names the file; move it aside to resume with
                the identity mapping, which measures staleness in weight versions as before).
        """
        if not path.exists():
            return cls()
        try:
            return cls([(v, t) for v, t in json.loads(path.read_text())["starts"]])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a version timeline ({e}); move it aside to resume measuring "
                             "staleness in weight versions") from None


class SampledTimelines:
    """Timeline version of each trajectory's oldest sampled token, kept from its first look until
    it is trained or dropped (:meth:`forget`): a weight version's timeline version never changes
    once published, and the trajectory holds no later one."""

    def __init__(self) -> None:
        self.at: dict[str, int] = {}  # trajectory id -> timeline version of its oldest sampled token

    def of(self, timeline: VersionTimeline, traj: Trajectory) -> int:
        """Timeline version (under ``timeline``) of ``traj``'s oldest sampled token; -1 when it has none."""
        tid = traj.trajectory_id
        if tid not in self.at:
            self.at[tid] = timeline.oldest(traj.versions[traj.loss_mask.astype(bool)])
        return self.at[tid]

    def staleness(self, timeline: VersionTimeline, timeline_version: int, traj: Trajectory) -> int:
        """``timeline_version`` (the learner's) minus :meth:`of`: a restart does not change it;
        negative for a trajectory a lost life sampled with weights the resumed learner has not
        re-trained to yet."""
        return timeline_version - self.of(timeline, traj)

    def forget(self, trajectory_id: str) -> None:
        """Trained or dropped: no longer kept."""
        self.at.pop(trajectory_id, None)
