"""Publication: the learner's weight versions, their timeline, and sending the policy to the samplers.

One :class:`Publisher` per learner owns what a published version is: the weight version (a number
never reused, noted durably in the receive log before each broadcast), the timeline version
staleness is measured in (t1async/learner/timeline.py: a restart does not advance it), and the
weight sync that carries the weights (t1async/weights/: the sending half; the samplers' receiving
half is t1async/weights/receiver.py). It also serves samplers that join while the learner waits
for a batch, and, after a resume, leaves the samplers serving the weights of the lost life when
those are as far along as the learner's timeline (:meth:`Publisher.connect`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from loguru import logger

from t1async.learner.disk_pause import DiskPause
from t1async.learner.timeline import TIMELINE_FILE, VersionTimeline
from t1async.sampling.sampler_client import SamplerError, post_json, weight_version
from t1async.transport.delivery import ReceiveLog
from t1async.weights.protocol import WeightSync, WeightSyncError


class Publisher:
    """The learner's side of weight publication.

    Args:
        sync: the weight sync (``weight_sync.mode``: distributed or tensor).
        weights: returns the policy's weights as ``(HF name, tensor)`` pairs (the backend's ``hf_weights``).
        log: the receive log, where each weight version is noted (and the timeline saved) before it
            is broadcast.
        pause: the learner's disk pause (a full disk waits for space before a version is noted).

    Attributes:
        version: the last weight version published (0 at start).
        timeline: weight version -> timeline version (t1async/learner/timeline.py).
        timeline_version: the learner's timeline version.
        weights_published: the policy's weights are those of the last version published.
        earlier_lives_version: resumed: weight versions up to this one were published by earlier
            learner lives (-1: never resumed).
    """

    def __init__(self, sync: WeightSync, weights: Callable[[], Iterable[tuple[str, Any]]], log: ReceiveLog,
                 pause: DiskPause):
        self.sync = sync
        self._weights = weights
        self._log = log
        self._pause = pause
        self.version = 0
        self.timeline = VersionTimeline()
        self.timeline_version = 0
        self.weights_published = False
        self.earlier_lives_version = -1
        self.resumed = False
        self._samplers_at = -1  # resumed: timeline version of the (lost life's) weights the samplers kept
        self._republish_same = False  # resumed at a checkpoint whose weights are the last version published
        self._managed = False  # the launch's sampler pool sets the membership (set_members)

    def restore(self, version: int, timeline_version: int, weights_published: bool | None) -> None:
        """A resume: take the checkpoint's ``version`` and ``timeline_version`` (``self.timeline``
        already loaded from the receive log). ``weights_published``: the checkpoint's flag, None
        without a checkpoint.

        Weights published after that checkpoint are lost: the next publication takes a new, higher
        number, so versions never repeat; unless the checkpoint was written right after a
        publication and nothing was published since: the samplers hold exactly these weights as
        this version, so it is sent again unchanged (a restart then does not make every trajectory
        in flight one version staler)."""
        self.version, self.timeline_version = version, timeline_version
        self._republish_same = bool(weights_published) and self._log.published_version == version
        self.version = max(self.version, self._log.published_version)
        self.earlier_lives_version = self.version
        self.resumed = True

    def connect(self, urls: list[str], step: int) -> None:
        """Form the weight group with every sampler and publish (version 0 at start).

        A resumed learner whose samplers all still hold weights of an earlier life at or past its
        own timeline version (the usual case after a kill: the samplers keep the last version the
        dead learner published) leaves them serving those and publishes nothing until its timeline
        has moved past them (:meth:`publish`): the episodes in flight, and those started
        meanwhile, keep sampling weights as far along as before the kill instead of the
        checkpoint's older ones."""
        self.sync.connect(urls)
        if not self._keep_samplers_weights(urls):
            self.publish(step)

    def _keep_samplers_weights(self, urls: list[str]) -> bool:
        """Resumed: whether every sampler holds the last weight version this run started to
        publish (so that publication completed: only its last bucket sets the version,
        t1async/weights/distributed.py) and its timeline version is at least the learner's; if so
        each is sent ``/continue_generation`` (the dead learner may have paused it after the last
        bucket), they count as holding it (``WeightSync.held``) and :attr:`_samplers_at` is its
        timeline version. Otherwise (a sampler restarted or unreachable, a publication cut short)
        the checkpoint's weights are published, as a new version."""
        if not self.resumed or not urls:
            return False
        last = self._log.published_version
        try:
            held = {u: int(weight_version(u, timeout_s=10)) for u in urls}
            if set(held.values()) != {last} or self.timeline.at(last) < self.timeline_version:
                return False
            for u in urls:
                post_json(u, "/continue_generation", {}, timeout_s=10)
        except (SamplerError, OSError, ValueError) as e:
            logger.info("resumed: the samplers' weight versions are unknown ({}); publishing the checkpoint's", e)
            return False
        at = self.timeline.at(last)
        self.sync.held.update(held)
        self._samplers_at, self._republish_same = at, False
        logger.info("resumed at timeline version {}: the samplers keep weight version {} (timeline version {}) "
                    "until the learner re-trains past it", self.timeline_version, last, at)
        return True

    def set_members(self, urls: list[str]) -> None:
        """The samplers to publish to from now on (the launch's sampler pool: live scaling, a
        restarted sampler). Departed ones leave the group at the next publish, which never waits
        for them. New ones get weights before they serve (:meth:`serve_joiners`)."""
        self._managed = True
        self.sync.set_members(urls)

    def publish(self, step: int, advance: bool = False) -> None:
        """Broadcast the policy to every sampler as the next version (version 0 at start).

        ``step``: the learner's step (no step and no version yet: this is version 0).
        ``advance``: a regular publication (every ``publish_every`` steps): the timeline version
        advances by one. Otherwise (the first publication of a life, a joining sampler's) the
        weights are fewer than ``publish_every`` updates past the timeline version they keep,
        and the timeline gets a new start at this weight version, written before the broadcast
        (t1async/learner/timeline.py).

        Raises:
            WeightSyncError: no sampler took the update and no sampler pool replaces failed ones.
        """
        if advance:
            self.timeline_version += 1
            if self.timeline_version <= self._samplers_at:  # (connect kept the samplers' weights)
                logger.info("timeline version {}: not published, the samplers hold weights as far along (timeline "
                            "version {})", self.timeline_version, self._samplers_at)
                return
        if (step > 0 or self.version > 0) and not self._republish_same:  # (version > 0 at step 0: resumed
            self.version += 1                                             # before the first checkpoint)
        self._republish_same = False
        rebased = self.timeline.at(self.version) != self.timeline_version
        if rebased:
            self.timeline.rebase(self.version, self.timeline_version)
        if not self._note_published(save_timeline=rebased):
            logger.error("weight version {} not published: stopped while the disk was full", self.version)
            return
        self.weights_published = True
        t0 = time.perf_counter()
        try:
            self.sync.publish(self._weights(), self.version)
        except WeightSyncError as e:
            # failed samplers are out of service (paused, never serving partial weights); carry on
            # while any sampler took the update, or while the launch's pool replaces failed
            # samplers (set_members), else this learner cannot publish at all
            if not self._managed and not [u for u in self.sync.urls if u not in self.sync.failed]:
                raise
            logger.error("weight version {}: {}", self.version, e)
        logger.info("published weight version {} in {:.2f} s (samplers paused {:.2f} s)", self.version,
                    time.perf_counter() - t0, self.sync.last_pause_s)

    def serve_joiners(self, step: int) -> bool:
        """Give new samplers weights while the learner waits for a batch: the last version at
        once, in a group of their own, when the policy has not moved since it was published; a
        new version to everyone when it has and no other sampler serves. Returns whether a new
        version was published (the controller must then be told the timeline version)."""
        joiners = self.sync.joiners()
        if not joiners:
            return False
        if self.weights_published:
            t0 = time.perf_counter()
            try:
                self.sync.load(self._weights(), self.version, joiners)
            except WeightSyncError as e:
                logger.error("{}", e)
                return False
            logger.info("samplers {} joined with weight version {} in {:.2f} s (the others not paused)", joiners,
                        self.version, time.perf_counter() - t0)
        elif not [u for u in self.sync.members() if u in self.sync.held]:
            logger.warning("no sampler holds weights: publishing the policy as a new version for {}", joiners)
            self.publish(step)
            return True
        return False

    def _note_published(self, save_timeline: bool) -> bool:
        """Record durably that ``self.version`` is being published, and with ``save_timeline`` the
        timeline's new start (before the broadcast: a version number is never reused); on a full
        disk wait for space and try again. False: stopped while waiting (nothing is broadcast)."""
        todo = {"timeline": save_timeline}

        def record() -> None:
            if todo["timeline"]:
                self.timeline.save(self._log.dir / TIMELINE_FILE, fsync=self._log.fsync)
                todo["timeline"] = False
            self._log.note_published(self.version)

        return self._pause.retry(record, self._log.dir, f"weight version {self.version}")

    def status(self) -> dict[str, Any]:
        """The weight group's snapshot (members, failed, held versions; ``WeightSync.snapshot``)."""
        return self.sync.snapshot()

    def close(self) -> None:
        """Leave the weight group."""
        self.sync.close()
