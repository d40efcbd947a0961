"""The launch process's embedded samplers: live scaling (``t1async scale sampler.num_samplers=M``)
and self-healing, plus the restart back-off every supervised role shares (:class:`Backoff`).

    scale(M) --> new Ray actors ("starting") | the highest-numbered ones drained ("draining")
    supervision thread, every 0.25 s:
      starting --its URL answered--> joining: learner.set_samplers(members)
      joining  --holds the learner's weights--> serving: controller.set_samplers(serving)
      draining --drain() returned (in-flight requests done)--> killed, removed
      joining | serving --actor died, 3 failed health checks in a row, or taken out of service
                by a failed weight update--> killed; Backoff --> "backoff" --wait--> starting
                (same name) or, past ``run.sampler_restarts`` deaths in a row, "failed"

Invariants: rollout actors are routed only to ``serving`` samplers (they hold weights: a new
sampler answers /generate 503 until then, and is never routed before); the weight group's members
are the ``joining`` and ``serving`` ones (a draining or dead sampler has left it, so no publish
waits for it). How a joiner gets weights is the learner's side (t1async/learner/publisher.py ``Publisher.set_members``).

Every change of a slot happens in the supervision thread (other threads read, or set ``target``).
Waits on: Ray (actor start, death, drain) and the samplers' ``GET /health``. Stopped by :meth:`close`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from loguru import logger

from t1async.actors import error_line, killed_for_memory
from t1async.sampling.sampler_client import SamplerError, SamplerUnavailable, post_json

MAX_BACKOFF_S = 60.0  # longest wait before restarting a role that keeps dying
TICK_S = 0.25
HEALTH_EVERY_S = 2.0
HEALTH_FAILS = 3  # failed health checks in a row that count as a death
DRAIN_S = 30.0  # most seconds a scaled-down sampler gets to finish its running requests


class Backoff:
    """Restarts of a role that keeps dying: wait min(``base_s`` x 2^k, ``max_s``) s before the
    restart, k = deaths in a row; a life that did useful work (a learner trained a step, a sampler
    served a request) starts a new row; past ``limit`` deaths in a row, give up.

    Attributes:
        in_row: deaths in the current row. restarts: restarts granted in all.
    """

    def __init__(self, limit: int, base_s: float = 5.0, max_s: float = MAX_BACKOFF_S):
        self.limit, self.base_s, self.max_s = limit, base_s, max_s
        self.in_row = 0
        self.restarts = 0

    def next_wait(self, worked: bool) -> float | None:
        """Seconds to wait before restarting after a death, or None: give up (``limit`` reached)."""
        if worked:
            self.in_row = 0
        if self.in_row >= self.limit:
            return None
        wait = min(self.base_s * 2 ** self.in_row, self.max_s)
        self.in_row += 1
        self.restarts += 1
        return wait


@dataclass
class Slot:
    """One sampler place (``sampler<index>``), kept across its restarts."""

    index: int
    backoff: Backoff
    state: str = "starting"  # starting | joining | serving | draining | backoff | failed
    handle: Any = None
    url: str | None = None
    url_ref: Any = None
    life_ref: Any = None  # wait_closed(): ready when the actor dies
    drain_ref: Any = None
    started_at: float = field(default_factory=time.time)
    serving_at: float | None = None
    joined: dict[str, Any] | None = None  # weight version it entered routing with, and the learner's then
    restart_at: float = 0.0
    health_fails: int = 0
    requests: int = 0  # served in this life (seen at the last health check)
    error: str | None = None

    @property
    def name(self) -> str:
        return f"sampler{self.index}"


class SamplerPool:
    """Embedded samplers of a running service (see the module docstring).

    Args:
        start: ``index -> Ray handle`` of a new EmbeddedSampler (no weights yet).
        learner: ``() -> the learner's handle now`` (a restarted learner replaces it).
        controller: the controller's handle (routing: ``set_samplers``).
        restarts: ``run.sampler_restarts``, deaths in a row before a sampler is left failed.
        backoff_s: first back-off wait, seconds (then doubling up to 60 s).
    """

    def __init__(self, start: Callable[[int], Any], learner: Callable[[], Any], controller: Any, *, restarts: int,
                 backoff_s: float = 5.0):
        self.start_actor, self.learner, self.controller = start, learner, controller
        self.restarts_limit, self.backoff_s = restarts, backoff_s
        self.slots: list[Slot] = []
        self.target = 0
        self.restarts = 0  # restarts of every sampler, in all (also of places since removed)
        self.memory_kills = 0  # of their deaths, those Ray's memory monitor caused (the service backs off)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pushed: dict[str, list[str] | None] = {"members": None, "serving": None}
        self._next_health = 0.0

    # ---- called by launch and the control socket ------------------------------------------
    def adopt(self, handles: list[Any], urls: list[str]) -> None:
        """The samplers launch started (already in the learner's group, holding version 0)."""
        with self._lock:
            for i, (h, u) in enumerate(zip(handles, urls)):
                s = Slot(i, Backoff(self.restarts_limit, self.backoff_s), state="serving", handle=h, url=u,
                         serving_at=time.time())
                s.life_ref = h.wait_closed.remote()
                self.slots.append(s)
            self.target = len(self.slots)
            # the learner is told the membership at the first round: from then on it knows that failed
            # samplers are replaced (it carries on when every sampler failed an update)
            self._pushed = {"members": None, "serving": list(urls)}

    def controller_restarted(self, controller: Any) -> None:
        """A new controller replaced a dead one: route its rollout actors (tell it the serving list)."""
        self.controller = controller
        self._pushed["serving"] = None

    def learner_restarted(self) -> None:
        """A new learner joined the members it was started with; tell it the membership again."""
        self._pushed["members"] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="sampler-pool", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def scale(self, m: int) -> None:
        """Start or drain samplers until ``m`` are in service (failed ones are dropped first when shrinking)."""
        if m < 1:
            raise ValueError(f"sampler.num_samplers must be >= 1, got {m}")
        with self._lock:
            self.target = m  # the supervision thread starts or drains (every change of a slot happens there)
        logger.info("samplers scaled to {}", m)

    def member_urls(self) -> list[str]:
        """Samplers in the weight group: joining and serving."""
        with self._lock:
            return [s.url for s in self.slots if s.state in ("joining", "serving") and s.url]

    def serving_urls(self) -> list[str]:
        """Samplers rollout actors are routed to: serving (holding weights)."""
        with self._lock:
            return [s.url for s in self.slots if s.state == "serving" and s.url]

    def handles(self) -> list[Any]:
        with self._lock:
            return [s.handle for s in self.slots if s.handle is not None]

    def status(self) -> list[dict[str, Any]]:
        """Per sampler: name, state, url, restarts, last error, when it was started and entered
        serving, what it joined with, and its own stats (weight version, requests, first request)."""
        with self._lock:
            slots = list(self.slots)
        refs = {s.index: s.handle.stats.remote() for s in slots if s.handle is not None and s.state != "starting"}
        out = []
        for s in slots:
            row: dict[str, Any] = {"name": s.name, "state": s.state, "url": s.url, "restarts": s.backoff.restarts,
                                   "error": s.error, "started_at": s.started_at, "serving_at": s.serving_at,
                                   "joined": s.joined}
            if s.index in refs:
                try:
                    row.update(ray.get(refs[s.index], timeout=10))
                except Exception:
                    row["unreachable"] = True
            out.append(row)
        return out

    # ---- supervision ----------------------------------------------------------------------
    def _loop(self) -> None:
        """Every 0.25 s: :meth:`tick`; a failing tick is logged, never ends supervision."""
        while not self._stop.wait(TICK_S):
            try:
                self.tick()
            except Exception as e:
                logger.opt(exception=e).warning("sampler supervision: {}", e)

    def tick(self) -> None:
        """One supervision round (see the module docstring)."""
        with self._lock:
            slots = list(self.slots)
        lives = {s.life_ref: s for s in slots if s.life_ref is not None}
        if lives:
            ready, _ = ray.wait(list(lives), num_returns=len(lives), timeout=0)
            for ref in ready:
                s = lives[ref]
                if s.state != "draining":
                    self._died(s, _ray_error(ref))
        for s in slots:
            if s.state == "starting" and s.url_ref is not None and ray.wait([s.url_ref], timeout=0)[0]:
                try:
                    s.url = ray.get(s.url_ref)
                except Exception as e:
                    self._died(s, f"could not start: {error_line(e)}")
                    continue
                s.url_ref, s.state = None, "joining"
                s.life_ref = s.handle.wait_closed.remote()
                logger.info("{} started at {}: joins the weight group", s.name, s.url)
            elif s.state == "joining":
                self._check_joined(s)
            elif s.state == "draining" and s.drain_ref is not None and ray.wait([s.drain_ref], timeout=0)[0]:
                self._remove(s)
            elif s.state == "backoff" and time.monotonic() >= s.restart_at:
                self._launch(s)
        if time.monotonic() >= self._next_health:
            self._next_health = time.monotonic() + HEALTH_EVERY_S
            self._health(slots)
        with self._lock:
            self._reconcile()
        self._push()

    def _check_joined(self, s: Slot) -> None:
        try:
            version = ray.get(s.handle.stats.remote(), timeout=5)["weight_version"]
        except Exception as e:  # dead: seen through its life_ref
            logger.debug("{}: no stats yet ({})", s.name, e)
            return
        if version < 0:
            return
        try:
            learner_version = ray.get(self.learner().status.remote(), timeout=5)["version"]
        except Exception:
            learner_version = None
        s.state, s.serving_at = "serving", time.time()
        s.joined = {"weight_version": version, "learner_version": learner_version,
                    "after_s": round(s.serving_at - s.started_at, 2)}
        logger.info("{} holds weight version {} (learner at {}), {:.1f} s after it was started: serving", s.name,
                    version, learner_version, s.serving_at - s.started_at)

    def _health(self, slots: list[Slot]) -> None:
        """``GET /health`` of every joining or serving sampler (503 while it has no weights is
        healthy); HEALTH_FAILS failures in a row, or a sampler the learner took out of service
        (a failed weight update left it paused), count as a death."""
        try:
            failed = ray.get(self.learner().status.remote(), timeout=5)["weight_group"]["failed"]
        except Exception:
            failed = {}
        for s in slots:
            if s.state not in ("joining", "serving") or not s.url:
                continue
            if s.url in failed:
                self._died(s, f"taken out of service by the learner: {failed[s.url]}")
                continue
            try:
                post_json(s.url, "/health", method="GET", timeout_s=5)
                s.health_fails = 0
            except SamplerUnavailable as e:
                if "HTTP 503" in str(e):
                    s.health_fails = 0
                else:
                    s.health_fails += 1
            except SamplerError:
                s.health_fails += 1
            if s.health_fails >= HEALTH_FAILS:
                self._died(s, f"failed {HEALTH_FAILS} health checks in a row")
                continue
            if s.state == "serving":
                try:
                    s.requests = ray.get(s.handle.stats.remote(), timeout=5)["requests"]
                except Exception:
                    pass

    def _died(self, s: Slot, why: str) -> None:
        """Kill what is left of it; back off, or leave it failed (see :class:`Backoff`)."""
        with self._lock:
            if s.state in ("backoff", "failed") or s not in self.slots:
                return
            if s.handle is not None:
                try:
                    ray.kill(s.handle, no_restart=True)
                except Exception:
                    pass
            self.memory_kills += killed_for_memory(why)
            wait = s.backoff.next_wait(worked=s.requests > 0)
            s.handle = s.url = s.url_ref = s.life_ref = None
            s.requests, s.health_fails, s.error, s.serving_at, s.joined = 0, 0, why, None, None
            if wait is None:
                s.state = "failed"
                logger.error("{} died ({}) {} times in a row: not restarted; see logs/{}.log, then "
                             "t1async scale RUN_DIR sampler.num_samplers=M to replace it", s.name, why,
                             s.backoff.in_row + 1, s.name)
            else:
                self.restarts += 1
                s.state, s.restart_at = "backoff", time.monotonic() + wait
                logger.error("{} died ({}); restart {} of {} in a row in {:.0f} s", s.name, why, s.backoff.in_row,
                             s.backoff.limit, wait)

    def _launch(self, s: Slot) -> None:
        s.handle = self.start_actor(s.index)
        s.url_ref = s.handle.url.remote()
        s.state, s.started_at = "starting", time.time()

    def _remove(self, s: Slot) -> None:
        try:
            ray.kill(s.handle, no_restart=True)
        except Exception:
            pass
        with self._lock:
            self.slots.remove(s)
        logger.info("{} drained and stopped", s.name)

    def _reconcile(self) -> None:
        """Start or drain samplers to meet ``target`` (under the lock)."""
        active = [s for s in self.slots if s.state not in ("draining",)]
        extra = len(active) - self.target
        # shrink: failed and restarting places first, then the highest-numbered
        for s in sorted(active, key=lambda s: (s.state not in ("failed", "backoff"), -s.index))[:max(extra, 0)]:
            if s.state in ("failed", "backoff") or s.handle is None:
                self.slots.remove(s)
                continue
            s.state = "draining"
            s.drain_ref = s.handle.drain.remote(DRAIN_S)
            logger.info("{} draining: out of routing and the weight group", s.name)
        used = {s.index for s in self.slots}
        for _ in range(max(-extra, 0)):
            i = next(k for k in range(len(used) + 1) if k not in used)
            used.add(i)
            s = Slot(i, Backoff(self.restarts_limit, self.backoff_s))
            self.slots.append(s)
            self._launch(s)
            logger.info("{} starting", s.name)

    def _push(self) -> None:
        """Tell the learner (weight group members) and the controller (routing) what changed;
        routing first when a sampler leaves, so no rollout actor is sent to it meanwhile."""
        targets = (("serving", self.serving_urls(), lambda: self.controller.set_samplers),
                   ("members", self.member_urls(), lambda: self.learner().set_samplers))
        for key, urls, method in targets:
            if urls == self._pushed[key]:
                continue
            try:
                ray.get(method().remote(urls), timeout=10)
                self._pushed[key] = urls
            except Exception as e:  # a restarting learner: told again next round
                logger.debug("could not tell the {} list {}: {}", key, urls, e)


def _ray_error(ref: Any) -> str:
    try:
        ray.get(ref, timeout=1)
        return "its server stopped"
    except Exception as e:
        return f"the actor died ({error_line(e)})"


__all__ = ["Backoff", "SamplerPool", "Slot"]
