"""The running service, in the launch process: control requests, the learner's supervision, the
live status line and the TensorBoard events.

    learner.run(controller) --(poll every second)--> done: return its status
                                                     died: restart it from its last checkpoint and
                                                           the receive log (back-off 5, 10, 20 s...)
                                                           or, past run.learner_restarts, one line
    controller.run() --(same poll)--> died (its rollout actors with it): the learner ends its run
                                      (checkpoint) and restarts, then a new controller continues
                                      admission from it (launch.restart_controller)
    every 5 s: node memory and memory kills --> MemoryBackoff (t1async/service/memory.py): fewer
                                                rollout actors while memory is short, one line each way
    metrics.jsonl --(tail)--> TensorBoard events (RUN_DIR/tensorboard), wandb (metrics.wandb; sinks.py)
                              + status line (a TTY) or log lines
    control socket (t1async/service/control.py) --> status | stop | scale (live-safe keys only; rollout
                                                    actors and samplers within the cluster's capacity)
    SIGINT, SIGTERM, SIGHUP --> stop after the learner's current step (final checkpoint)
    t1async stop --now, a second signal --> the same, but a learner still in its step after
                                            NOW_GRACE_S is ended there (ray.kill): its receive log
                                            and consumed-id ledger make that safe (a resume trains
                                            what it had ACKed and not checkpointed)

Waits on: the learner's ``run`` and the controller's. Stopped by: the learner finishing ``max_steps``, ``t1async
stop``, a signal, or a learner that keeps dying. Nothing in this loop waits on the disk: a full
run directory makes ``status`` say ``degraded: disk full at PATH (N MB free)`` (the learner's
pause, or this process's own writes refused), and stop and signals work as ever.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import ray
from loguru import logger
from omegaconf import OmegaConf
from rich.console import Console
from rich.live import Live
from rich.text import Text

from t1async.actors import error_line
from t1async.config import Config, ConfigError, MetricsConfig, from_node
from t1async.fileio import DiskGuard
from t1async.learner.metrics import merge_agent_splits
from t1async.service.capacity import Capacity, scale_refusal
from t1async.service.control import LIVE_KEYS, live_change_refusal
from t1async.service.memory import MemoryBackoff, killed_for_memory, memory_line, node_memory_used, ray_memory_threshold
from t1async.service.rundir import append_history
from t1async.service.sampler_pool import Backoff, SamplerPool
from t1async.service.sinks import TensorBoardSink, WandbSink

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ROLE_DIED = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)
"""What a call of a dead role raises: Ray's memory monitor's kill is an ``OutOfMemoryError``, not
an actor error (seen: it killed learner, controller, sampler and a rollout actor at once)."""
NOW_GRACE_S = 2.0
"""``t1async stop --now`` (or a second signal): seconds the learner gets to finish on its own (it
writes its final checkpoint when it is between steps) before it is ended mid-step."""
TB_SKIP = ("step", "version", "time", "phase", "train_policy")


class LearnerDied(RuntimeError):
    """The learner died and was not (or could no more be) restarted; the message says how to resume."""


class MetricsTail:
    """Reads rows appended to ``metrics.jsonl`` since the last call; sends their numbers (dict fields
    as ``name/key``, maps in them ``name/key/key``) to TensorBoard (``RUN_DIR/tensorboard``) and, with
    ``metrics.wandb``, Weights & Biases: one point per step across the run's lives (t1async/service/sinks.py).

    Args:
        path: ``RUN_DIR/metrics.jsonl``.
        tensorboard: write TensorBoard events (``run.tensorboard``).
        metrics: the ``metrics`` section (wandb); None: no wandb.
        disk: the run directory's disk guard (a refused write is recorded there); None: none.
        config: the run's config, recorded with a wandb run.
    """

    def __init__(self, path: Path, tensorboard: bool, metrics: MetricsConfig | None = None,
                 disk: DiskGuard | None = None, config: dict[str, Any] | None = None):
        self.path, self.pos, self.rows = path, 0, []
        self.inode: int | None = None  # of the file read so far: a trim (MetricsFile.trim) replaces it
        self.bad_lines = 0  # lines that were not a metrics row (skipped, logged)
        self.sinks: list[Any] = []
        if tensorboard:
            self.sinks.append(TensorBoardSink(path.parent / "tensorboard", disk))
        if metrics is not None and metrics.wandb:
            self.sinks.append(WandbSink(path.parent / "wandb", metrics.wandb_project, metrics.wandb_mode, config))

    def poll(self) -> list[dict[str, Any]]:
        """New complete rows. A resumed learner's trim (a new file, or a shorter one) is followed:
        reading starts over (TensorBoard and wandb skip the points they already hold). A line that
        is not a JSON object with a ``step`` is skipped, counted in :attr:`bad_lines` and logged:
        the launch's display never ends the service."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino != self.inode or st.st_size < self.pos:
                self.inode, self.pos, self.rows = st.st_ino, 0, []
            f.seek(self.pos)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self.pos += end
        new = []
        for line in chunk[:end].splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                int(row["step"])
            except (ValueError, KeyError, TypeError) as e:
                self.bad_lines += 1
                logger.warning("metrics.jsonl: skipped a line that is not a metrics row ({}; {} so far): {!r}",
                               e, self.bad_lines, line[:80])
                continue
            new.append(row)
        self.rows = (self.rows + new)[-200:]
        for row in new:
            self._write(row)
        for sink in self.sinks:
            sink.flush()
        return new

    def _write(self, row: dict[str, Any]) -> None:
        if not self.sinks:
            return
        scalars: dict[str, float] = {}
        pending = [(key, value) for key, value in row.items() if key not in TB_SKIP]
        while pending:  # nested maps as name/key[/key...] (by_agent/codex/reward_mean)
            key, value = pending.pop(0)
            if isinstance(value, dict):
                pending += [(f"{key}/{sub}", v) for sub, v in value.items()]
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                scalars[key] = float(value)
        for sink in self.sinks:
            sink.write(int(row["step"]), float(row.get("time", time.time())), scalars)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class DiskNotice:
    """Says on the launch's console when the run's disk pauses the service and when it is back: one
    line each way (``t1async status`` shows the state meanwhile), not one per check."""

    def __init__(self) -> None:
        self.degraded: str | None = None  # why, while paused
        self.pauses = 0

    def update(self, why: str | None) -> None:
        """``why``: ``disk full at PATH (N MB free...)`` while the disk pauses intake and training, else None."""
        if why and not self.degraded:
            self.pauses += 1
            logger.warning("degraded: {}; intake and training are paused and resume by themselves when space "
                           "is back (t1async status shows it)", why)
        elif self.degraded and not why:
            logger.warning("disk space is back: intake and training resume")
        self.degraded = why


class Service:
    """The launch process's side of a running service.

    Args:
        cfg: the run's config (live changes are applied to it).
        run_dir: the run directory.
        roles: ``{"learner", "controller", "samplers"}`` Ray handles.
        restart_learner: ``() -> new learner handle`` (resumed from the last checkpoint, same endpoint).
        check_tasks: ``(names) -> None``; raises a one-line error when a task set cannot be used.
        samplers: the embedded samplers' pool (live scaling, restarts; t1async/service/sampler_pool.py),
            None for SGLang servers.
        capacity: what the Ray cluster can hold (t1async/service/capacity.py): ``scale`` refuses
            more rollout actors or samplers unless forced; None: no bound.
        restart_controller: ``(learner handle) -> (controller handle, its run ObjectRef)``: a new
            controller (and rollout actors) whose admission continues from that resumed learner's
            position; ``roles["controller_run"]`` is the first controller's run ObjectRef, watched
            for its death. None: a dead controller is not restarted.
    """

    def __init__(self, cfg: Config, run_dir: Path, roles: dict[str, Any], restart_learner: Callable[[], Any],
                 check_tasks: Callable[[list[str]], None], samplers: SamplerPool | None = None,
                 capacity: Capacity | None = None, restart_controller: Callable[[Any], tuple[Any, Any]] | None = None):
        self.cfg, self.run_dir, self.roles, self.capacity = cfg, run_dir, roles, capacity
        self.restart_controller = restart_controller
        self.memory = MemoryBackoff(ray_memory_threshold())  # Ray's memory monitor: back off before it kills again
        self._rollout_memory_kills = 0  # the controller's count seen so far
        self._sampler_memory_kills = 0  # the sampler pool's count seen so far
        self._actors_unapplied: int | None = None  # a back-off target the controller has not taken yet
        self.restart_learner, self.check_tasks, self.samplers = restart_learner, check_tasks, samplers
        self.restarts = {"learner": 0, "controller": 0}
        self._learner_backoff = Backoff(cfg.run.learner_restarts)
        self.stop_request: str | None = None  # "drain" | "now" (t1async stop) | "signal"
        self.started = time.time()
        self.disk = DiskGuard(run_dir, cfg.learner.disk_floor_mb)  # this process's writes (TensorBoard, wandb)
        self.tail = MetricsTail(run_dir / "metrics.jsonl", cfg.run.tensorboard, cfg.metrics, self.disk,
                                config=OmegaConf.to_container(OmegaConf.structured(cfg)) if cfg.metrics.wandb else None)
        self._lock = threading.Lock()
        self._live = None
        self._life_started = time.time()  # (wall clock: compared with metrics rows)
        self.disk_notice, self._disk_next = DiskNotice(), 0.0  # the disk's state on the console, checked every 5 s

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        return {"status": self.status, "stop": self.request_stop, "scale": self.scale}

    # ---- control ------------------------------------------------------------------------
    def status(self, req: dict[str, Any] | None = None) -> dict[str, Any]:
        """Everything ``t1async status`` shows (see t1async/service/control.py format_status).
        ``state``: ``running``, ``stopping``, or ``degraded: WHY`` while the run directory's disk
        pauses the learner (``disk``, ``disk_paused_s`` from its status) or refuses this process's writes."""
        disk = self.disk.check()
        out: dict[str, Any] = {"ok": True, "run_dir": str(self.run_dir), "pid": os.getpid(),
                               "state": "stopping" if self.stop_request else f"degraded: {disk}" if disk else "running",
                               "uptime_s": round(time.time() - self.started, 1), "restarts": self.restarts,
                               "max_staleness": self.cfg.learner.max_staleness}
        try:
            ls = ray.get(self.roles["learner"].status.remote(), timeout=10)
            out.update({k: ls[k] for k in ("step", "version", "queue_depth", "dropped", "received", "rejected",
                                           "rejected_by", "quarantine_evicted", "duplicates", "trained",
                                           "max_steps", "ledger", "resumed", "weight_group")})
            # stale drops, and of them those a learner restart or a joining sampler's publication made (0 by design)
            out["dropped_stale"], out["dropped_stale_restart"] = ls.get("dropped_stale", 0), ls.get("dropped_stale_restart", 0)
            out["refused_handshakes"] = ls.get("refused_handshakes", {})
            out["disk_paused_s"] = ls.get("disk_paused_s", 0.0)
            if ls.get("disk") and not self.stop_request:  # the learner's pause (its own writes, its view)
                out["state"] = f"degraded: {ls['disk']}"
        except Exception as e:
            out["learner_error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        try:
            cs = ray.get(self.roles["controller"].status.remote(), timeout=10)
            out["actors"] = cs["actors_detail"]  # (also left in "controller", where the controller reports it)
            out["episode_failures"] = cs.get("episode_failures")
            out["episode_failures_by_agent"] = cs.get("episode_failures_by_agent")
            out["controller"] = cs
        except Exception as e:
            out["controller_error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        if self.samplers is not None:  # embedded: the pool's view (states, restarts, how each joined)
            out["samplers"] = self.samplers.status()
            out["restarts"] = self.restart_counts()
        else:
            out["samplers"] = []
            for i, s in enumerate(self.roles.get("samplers", [])):
                try:
                    out["samplers"].append({"name": f"sampler{i}", "state": "serving",
                                            **ray.get(s.stats.remote(), timeout=10)})
                except Exception:
                    out["samplers"].append({"name": f"sampler{i}", "state": "unreachable"})
        out["memory"] = self.memory.status()
        out["memory"]["line"] = memory_line(out["memory"], out.get("step"), self.cfg.rollout.num_actors)
        if self.memory.reduced_to is not None and out["state"] == "running":
            out["state"] = (f"degraded: memory short ({self.memory.reason}): rollout actors reduced to "
                            f"{self.memory.reduced_to} of {self.cfg.rollout.num_actors}")
        out.update(trends(self.tail.rows))
        return out

    def restart_counts(self) -> dict[str, int]:
        """Restarts so far: ``learner``, and ``samplers`` (every embedded sampler's, in all) when
        the launch's sampler pool runs them (``status`` and ``summary.json`` report this)."""
        out = dict(self.restarts)
        if self.samplers is not None:
            out["samplers"] = self.samplers.restarts
        return out

    def request_stop(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.stop_request = "now" if req.get("now") else "drain"
        logger.warning("stop requested ({}) through the control socket", self.stop_request)
        return {"ok": True}

    def scale(self, req: dict[str, Any]) -> dict[str, Any]:
        """Apply live-safe changes (checked like a config override), log them and add them to
        the run's config history.

        Raises:
            ValueError: a key that cannot change live, or a value the config would refuse.
        """
        changes = req.get("changes")
        if not isinstance(changes, dict) or not changes or not all(isinstance(k, str) for k in changes):
            raise ValueError(f'scale: "changes" must be a non-empty JSON object of key: value, e.g. '
                             f'{{"rollout.num_actors": 4}}; got {json.dumps(changes, default=str)[:80]}')
        for key in changes:
            refusal = live_change_refusal(key)
            if refusal:
                raise ValueError(refusal)
        try:  # the same type and value rules as a config file or a launch override
            merged = OmegaConf.merge(OmegaConf.structured(self.cfg), OmegaConf.from_dotlist(
                [f"{k}={json.dumps(v)}" for k, v in changes.items()]))
            new: Config = from_node(merged, source="scale")  # each section's rules, then the cross rules
        except ConfigError as e:
            raise ValueError(str(e)) from None
        except Exception as e:  # (omegaconf: a value of the wrong type; name the key and the value given)
            key = getattr(e, "full_key", None)
            given = f"={json.dumps(changes[key])}" if key in changes else ""
            raise ValueError(f"scale: bad value of {key}{given}: {str(e).splitlines()[0]}" if key
                             else f"scale: {str(e).splitlines()[0]}") from None
        if self.capacity is not None:  # (a scale past it flooded a node: 765 actors in 40 s)
            refusal = scale_refusal(self.capacity, new.rollout.num_actors,
                                    new.sampler.num_samplers if self.samplers is not None else 0, changes)
            if refusal and not req.get("force"):
                raise ValueError(refusal)
            if refusal:
                logger.warning("{} (forced: --force)", refusal.split("; add --force")[0])
        if "env.tasks" in changes:
            self.check_tasks(list(new.env.tasks))
        if "sampler.num_samplers" in changes and self.samplers is None:
            raise ValueError("sampler.num_samplers can change live only with sampler.backend=embedded; SGLang "
                             "servers are given at launch (sampler.urls or sampler.num_samplers)")
        learner_keys = {k.split(".", 1)[1]: getattr(new.learner, k.split(".", 1)[1])
                        for k in changes if k.startswith("learner.")}
        if learner_keys:
            ray.get(self.roles["learner"].set_live.remote(learner_keys), timeout=30)
        ctrl = {}
        if "learner.max_staleness" in changes:
            ctrl["max_staleness"] = new.learner.max_staleness
        if "env.tasks" in changes:
            ctrl["tasks"] = list(new.env.tasks) or None
        if ctrl:
            if ctrl.get("tasks", 0) is None:
                raise ValueError("env.tasks=[] (every task) cannot be set live; name the tasks")
            ray.get(self.roles["controller"].set_live.remote(ctrl), timeout=30)
        if "rollout.num_actors" in changes:  # (while memory is short, at most what the back-off allows)
            ray.get(self.roles["controller"].scale.remote(min(new.rollout.num_actors, self.memory.reduced_to or
                                                              new.rollout.num_actors)), timeout=30)
        if "sampler.num_samplers" in changes and self.samplers is not None:
            self.samplers.scale(new.sampler.num_samplers)
        self.cfg = new
        applied = {k: _get(new, k) for k in changes}
        append_history(self.run_dir, applied, "t1async scale --force" if req.get("force") else "t1async scale")
        logger.info("live change applied and recorded in config_history.jsonl: {}", applied)
        return {"ok": True, "applied": applied}

    # ---- the main loop ------------------------------------------------------------------
    def run(self) -> tuple[dict[str, Any], str]:
        """Run the learner to its end (see the module docstring); returns ``(learner status, how
        it ended)`` with how = ``done``, ``stopped`` (t1async stop) or ``signal``; the status's
        ``ended_mid_step`` says whether ``stop --now`` (or a second signal) ended the learner inside
        a step (then the status is only ``step`` and ``ended_mid_step``).

        Raises:
            LearnerDied: it died more than ``run.learner_restarts`` times, or its run raised (one
                line; the traceback is in ``logs/learner.log``).
        """
        received: list[int] = []

        def on_signal(signum: int, frame: Any) -> None:
            received.append(signum)
            if signum == signal.SIGHUP:  # the terminal is gone: later writes to it would fail
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)

        # Set explicitly: a launch started in the background by a script inherits SIGINT ignored
        # (POSIX shells do that to `&` jobs), and Python then leaves it ignored; `kill -INT` must still stop it.
        previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
        learner = self.roles["learner"]
        run_ref = learner.run.remote(self.roles["controller"])
        asked, asked_at = False, 0.0
        self._start_status_line()
        if self.samplers is not None:
            self.samplers.start()
        try:
            while True:
                watched = [run_ref] + [r for r in [self.roles.get("controller_run")] if r is not None]
                ready, _ = ray.wait(watched, num_returns=len(watched), timeout=1.0)  # (both, when both died)
                controller_died = self._controller_died(ready, wait_s=0)
                if run_ref in ready and controller_died is None:
                    try:
                        result = ray.get(run_ref)
                    except ROLE_DIED as e:
                        if asked:
                            raise LearnerDied(self._died_line(e, "while stopping")) from None
                        self._memory_kill("learner", e)
                        learner = self._restart(e)
                        run_ref = learner.run.remote(self.roles["controller"])
                        continue
                    except ray.exceptions.RayError as e:  # its run raised: the controller it calls died?
                        controller_died = self._controller_died(None, wait_s=10)
                        if controller_died is None or asked:  # (one line, not Ray's traceback; exit status 1)
                            raise LearnerDied(self._died_line(e, "while stopping" if asked else "in its run")) from None
                    else:
                        how = "signal" if received else "stopped" if self.stop_request else "done"
                        result.setdefault("ended_mid_step", False)  # (True only from _end_learner_now)
                        if result.get("checkpoint_failed"):  # (launch's caller says so in its exit status too)
                            logger.error("the learner stopped, but its final checkpoint did not fit: {}",
                                         result["checkpoint_failed"])
                        return result, how
                if controller_died is not None:
                    if asked:  # stopping anyway: the learner's run ends with the controller's calls
                        continue
                    learner, run_ref = self._replace_controller(learner, run_ref, controller_died)
                    continue
                self._show(self.tail.poll())
                if time.monotonic() >= self._disk_next:
                    self._disk_next = time.monotonic() + 5.0
                    self.disk_notice.update(self.disk.check() or self._learner_disk(learner))
                    self._check_memory()
                if (received or self.stop_request) and not asked:
                    what = (f"signal {signal.Signals(received[0]).name}" if received
                            else f"t1async stop{' --now' if self.stop_request == 'now' else ''}")
                    logger.warning("{}: stopping the learner {}", what,
                                   f"now (ended in its step after {NOW_GRACE_S:.0f} s)" if self._now(received)
                                   else "after its current step (final checkpoint follows)")
                    asked, asked_at = True, time.monotonic()
                    try:
                        ray.get(learner.stop.remote(), timeout=min(30.0, NOW_GRACE_S if self._now(received) else 30.0))
                    except Exception as e:  # a dead learner is seen by the wait above (or a step holds it)
                        logger.warning("could not ask the learner to stop: {}", error_line(e))
                if asked and self._now(received) and time.monotonic() - asked_at >= NOW_GRACE_S:
                    return self._end_learner_now(learner, received), "signal" if received else "stopped"
        finally:
            if self.samplers is not None:
                self.samplers.close()
            self._stop_status_line()
            self._show(self.tail.poll())
            self.tail.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _now(self, received: list[int]) -> bool:
        """Whether the stop asked for may not wait for the learner's step: ``t1async stop --now`` or a
        second signal."""
        return self.stop_request == "now" or len(received) >= 2

    def _end_learner_now(self, learner: Any, received: list[int]) -> dict[str, Any]:
        """End a learner still in its step (``ray.kill``), and say so; returns the summary's ``learner``
        part: the last step in ``metrics.jsonl`` and ``ended_mid_step``. Nothing is lost: every
        trajectory it ACKed is in its receive log (RUN_DIR/receive_log) or consumed by its last
        checkpoint, and a resume trains those again from that checkpoint; the actors resend the rest."""
        why = "a second signal" if len(received) >= 2 else "t1async stop --now"
        self.tail.poll()
        step = self.tail.rows[-1].get("step", 0) if self.tail.rows else 0
        logger.warning("{}: the learner did not stop within {:.0f} s; ending it in its step (nothing is lost: its "
                       "receive log keeps every trajectory it acknowledged; resume with t1async launch CONFIG "
                       "run.dir={} learner.resume=true)", why, NOW_GRACE_S, self.run_dir)
        try:
            ray.kill(learner, no_restart=True)
        except Exception as e:  # already gone
            logger.warning("could not end the learner: {}", error_line(e))
        self.roles["learner"] = None  # (launch's shutdown has no learner left to close)
        return {"step": step, "ended_mid_step": True}

    def _restart(self, err: Exception) -> Any:
        """A new learner, resumed from the last checkpoint and the receive log, after the back-off
        of :class:`~t1async.service.sampler_pool.Backoff` (5 x 2^k s up to 60 s, k = deaths in a row of
        learners that trained no step: a learner that keeps dying is never restarted in a tight
        loop; past ``run.learner_restarts`` such deaths in a row the service stops with one line).
        A learner that dies while starting (killed again, its port not yet free) counts as one
        more death in the row."""
        while True:
            self.tail.poll()
            worked = any(r.get("time", 0) > self._life_started for r in self.tail.rows[-1:])  # trained in this life
            wait = self._learner_backoff.next_wait(worked)
            if wait is None:
                raise LearnerDied(self._died_line(err, f"after {self._learner_backoff.in_row} restarts in a row"))
            self.restarts["learner"] += 1
            logger.error("the learner died ({}); restart {} of {} in a row in {:.0f} s from its last checkpoint",
                         error_line(err), self._learner_backoff.in_row, self.cfg.run.learner_restarts, wait)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and not self.stop_request:
                time.sleep(0.2)
            self._life_started = time.time()
            try:
                self.roles["learner"] = self.restart_learner()
            except Exception as e:  # died again while starting: one more in the row
                err = e
                continue
            if self.samplers is not None:
                self.samplers.learner_restarted()
            return self.roles["learner"]

    def _controller_died(self, ready: list[Any] | None, wait_s: float) -> Exception | None:
        """The error the controller died of, or None while it lives (or returned: it stopped
        itself). ``ready``: refs ``ray.wait`` found ready (None: wait up to ``wait_s`` here)."""
        ref = self.roles.get("controller_run")
        if ref is None:
            return None
        if ready is None:
            ready, _ = ray.wait([ref], timeout=wait_s)
        if ref not in ready:
            return None
        try:
            ray.get(ref)
        except ROLE_DIED as e:
            return e
        except Exception:  # (its run raised: it lives on, unsupervised; seen as before)
            pass
        self.roles["controller_run"] = None
        return None

    def _replace_controller(self, learner: Any, run_ref: Any, err: Exception) -> tuple[Any, Any]:
        """The controller died (its rollout actors with it, Ray's fate-sharing): let the learner
        end its run with a final checkpoint (up to 120 s), kill it, restart it from that
        checkpoint and the receive log (:meth:`_restart`, with its back-off), then start a new
        controller whose admission continues from the restarted learner's position; the new
        rollout actors resend what the dead ones spooled. Returns the new learner and its run."""
        self._memory_kill("controller", err)
        self.restarts["controller"] += 1
        logger.error("the controller died ({}); its rollout actors died with it: restarting the learner from its "
                     "checkpoint and the controller after it (restart {})", error_line(err), self.restarts["controller"])
        self.roles["controller_run"] = None
        try:
            ray.get(learner.stop.remote(), timeout=30)
            ray.wait([run_ref], timeout=120)  # (its run ends at the next call to the dead controller: a checkpoint)
        except Exception as e:  # a dead learner is restarted below all the same
            logger.warning("the learner did not stop by itself ({}); killing it", error_line(e))
        try:
            ray.kill(learner, no_restart=True)
            ray.wait([run_ref], timeout=30)
        except Exception:
            pass
        learner = self._restart(err)
        if self.restart_controller is None:
            raise LearnerDied(f"the controller died ({error_line(err)}) and this service cannot restart it; resume "
                              f"with t1async launch CONFIG run.dir={self.run_dir} learner.resume=true")
        self.roles["controller"], self.roles["controller_run"] = self.restart_controller(learner)
        if self.samplers is not None:
            self.samplers.controller_restarted(self.roles["controller"])
        if self.memory.reduced_to is not None:
            self._scale_actors(self.memory.reduced_to)
        return learner, learner.run.remote(self.roles["controller"])

    def _memory_kill(self, role: str, err: Exception) -> None:
        if killed_for_memory(err):
            self.memory.role_killed(role, step=self._last_step())
            logger.warning("Ray's memory monitor killed the {} (node memory short); it is restarted and the service "
                           "backs off (fewer rollout actors) while memory stays short", role)

    def _last_step(self) -> int:
        """The learner's last step in ``metrics.jsonl`` as last read by the main loop (0 before the
        first; not polled here: the main loop shows and forwards each new row)."""
        return int(self.tail.rows[-1].get("step", 0)) if self.tail.rows else 0

    def _check_memory(self) -> None:
        """Every 5 s: rollout actors Ray's memory monitor killed (the controller's count), the
        node's memory in use, and the back-off's answer: the rollout actors' target to apply and
        one console line when it changes (t1async/service/memory.py)."""
        try:
            kills = int(ray.get(self.roles["controller"].status.remote(), timeout=5).get("memory_kills", 0))
        except Exception:
            kills = self._rollout_memory_kills
        if kills > self._rollout_memory_kills:
            self.memory.role_killed("rollout actor", step=self._last_step())
            logger.warning("Ray's memory monitor killed {} rollout actor(s) (node memory short); they are replaced "
                           "and the service backs off while memory stays short", kills - self._rollout_memory_kills)
        self._rollout_memory_kills = kills
        sampler_kills = self.samplers.memory_kills if self.samplers is not None else 0
        if sampler_kills > self._sampler_memory_kills:  # (the pool restarts them; the back-off is ours)
            self.memory.role_killed("sampler", step=self._last_step())
            logger.warning("Ray's memory monitor killed {} sampler(s) (node memory short); they are restarted and the "
                           "service backs off while memory stays short", sampler_kills - self._sampler_memory_kills)
        self._sampler_memory_kills = sampler_kills
        target, line = self.memory.update(node_memory_used(), self.cfg.rollout.num_actors)
        if line:
            logger.warning("{}", line)
        if target is not None or self._actors_unapplied is not None:
            self._scale_actors(target if target is not None else self._actors_unapplied)

    def _scale_actors(self, n: int) -> None:
        """Tell the controller the rollout actors' target; one it did not take (busy, restarting)
        is tried again at the next memory check."""
        try:
            ray.get(self.roles["controller"].scale.remote(n), timeout=10)
            self._actors_unapplied = None
        except Exception as e:  # a dead controller is seen by the main loop
            self._actors_unapplied = n
            logger.warning("could not scale the rollout actors to {} yet ({}); trying again", n, error_line(e))

    @staticmethod
    def _learner_disk(learner: Any) -> str | None:
        """Why the learner has paused for the disk (its own writes' faults, its floor), or None (also
        when it does not answer within 5 s: a dead learner is seen by the main loop)."""
        try:
            return ray.get(learner.status.remote(), timeout=5).get("disk")
        except Exception:
            return None

    def _died_line(self, err: Exception, when: str) -> str:
        return (f"the learner died {when} ({error_line(err)}; see {self.run_dir}/logs/learner.log); nothing sent "
                f"is lost: resume with t1async launch CONFIG run.dir={self.run_dir} learner.resume=true")

    # ---- look inside --------------------------------------------------------------------
    def _start_status_line(self) -> None:
        """A rich live line on a terminal; plain log lines otherwise (see :meth:`_show`)."""
        if not sys.stderr.isatty():
            return
        self._live = Live("", console=Console(stderr=True), refresh_per_second=2, transient=True,
                          redirect_stderr=True, redirect_stdout=True)
        self._live.start()

    def _stop_status_line(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _actors_line(self) -> str:
        n = self.cfg.rollout.num_actors
        return f"{self.memory.reduced_to}/{n} (memory short)" if self.memory.reduced_to is not None else str(n)

    def _samplers_line(self) -> str:
        if self.samplers is None:
            return str(self.cfg.sampler.num_samplers)
        return f"{len(self.samplers.serving_urls())}/{self.samplers.target}"

    def _show(self, new_rows: list[dict[str, Any]]) -> None:
        if not new_rows and self._live is None:
            return
        t = trends(self.tail.rows)
        last = self.tail.rows[-1] if self.tail.rows else {}
        fields = [f"step {last.get('step', 0)}", f"v{last.get('version', 0)}", f"actors {self._actors_line()}",
                  f"samplers {self._samplers_line()}", f"traj/s {_fmt(t['trajectories_per_s'])}",
                  f"reward {_fmt(t['reward_recent'])}", f"resolved {_fmt(t['resolved_recent'])}",
                  f"staleness {last.get('staleness_max', '-')}", f"queue {last.get('queue_depth', '-')}",
                  f"restarts {self.restarts['learner']}"]
        if self._live is not None:  # one terminal line, never wrapped
            self._live.update(Text(fit_line(fields, self._live.console.width - 1), no_wrap=True, overflow="ellipsis"))
        elif new_rows:
            logger.info("  ".join(fields))


LINE_PRIORITY = (0, 1, 5, 6, 4, 7, 2, 3, 8, 9)
"""The status line's fields by importance (indices into its field list): step, version, reward,
resolved, traj/s, staleness, actors, samplers, queue, restarts; the last ones go first when the
terminal is narrow."""


def fit_line(fields: list[str], width: int, priority: tuple[int, ...] = LINE_PRIORITY) -> str:
    """``fields`` joined by two spaces, leaving out the least important (``priority``: indices, most
    important first; fields it does not name go first) until the line fits ``width`` columns; the
    most important field alone is cut to ``width``."""
    order = [i for i in priority if i < len(fields)] + [i for i in range(len(fields)) if i not in priority]
    for n in range(len(order), 0, -1):
        kept = sorted(order[:n])
        line = "  ".join(fields[i] for i in kept)
        if len(line) <= width:
            return line
    return fields[order[0]][:max(width, 0)] if order else ""


def trends(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rates and trends over metrics rows: trajectories/s (last 10 steps), reward and resolved
    rate of the last 5 steps against the 5 before, time since the last step, staleness, and the
    last 10 steps split by agent (``by_agent``: t1async/learner/metrics.py ``merge_agent_splits``)."""
    out: dict[str, Any] = {"trajectories_per_s": None, "reward_recent": None, "reward_before": None,
                           "resolved_recent": None, "resolved_before": None, "since_last_step_s": None,
                           "staleness_max": None, "by_agent": {}}
    if not rows:
        return out
    out["by_agent"] = merge_agent_splits(rows[-10:])
    window = rows[-10:]
    if len(window) >= 2 and window[-1]["time"] > window[0]["time"]:
        n = sum(r["trajectories"] for r in window[1:])
        out["trajectories_per_s"] = n / (window[-1]["time"] - window[0]["time"])
    for key, field in (("reward", "reward_mean"), ("resolved", "resolved_rate")):
        recent, before = rows[-5:], rows[-10:-5]
        out[f"{key}_recent"] = sum(r[field] for r in recent) / len(recent)
        out[f"{key}_before"] = sum(r[field] for r in before) / len(before) if before else None
    out["since_last_step_s"] = round(time.time() - rows[-1]["time"], 1)
    out["staleness_max"] = max(r["staleness_max"] for r in rows)
    return out


def _get(cfg: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        cfg = getattr(cfg, name)
    return list(cfg) if isinstance(cfg, list) else cfg


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}"


__all__ = ["LIVE_KEYS", "LearnerDied", "MetricsTail", "Service", "fit_line", "trends"]
