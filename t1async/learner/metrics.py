"""The learner's metrics.jsonl: one row per step, built from the batch, written whole.

:func:`batch_metrics` is the part of a step's row that the batch and the learner's counters give
(docs/run-directory.md names every key); :class:`MetricsFile` appends rows whole
(t1async/fileio.py ``append_whole``) and keeps the rows a full or failing disk refused for the next
try (logged, never dropped).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from loguru import logger

from t1async.config import AbnormalConfig
from t1async.fileio import DiskGuard, append_whole, replace_file
from t1async.learner.abnormal import finish_counts, masked_turns, tool_call_counts, turn_counts
from t1async.trajectory import HISTORY_BREAK, Trajectory


def batch_metrics(batch: list[Trajectory], stale: list[int], abnormal: AbnormalConfig, *, step: int, version: int,
                  timeline_version: int, counters: dict[str, int], dropped: dict[str, int],
                  rejected_by: dict[str, int], queue_depth: int) -> dict[str, Any]:
    """The row of metrics.jsonl that a trained ``batch`` gives (before the step's own losses and timings).

    Args:
        batch: the trajectories the step trained (at least one).
        stale: their staleness in timeline versions (ints >= 0), in ``batch``'s order.
        abnormal: ``learner.abnormal`` (which turns are masked).
        step, version, timeline_version: the learner's, after the step.
        counters, dropped, rejected_by: the learner's cumulative counts (copied).
        queue_depth: trajectories received and not yet taken.
    """
    return {
        "step": step,
        "version": version,
        "timeline_version": timeline_version,
        "trajectories": len(batch),
        "trajectories_total": counters["trained"],
        "dropped_stale": counters["dropped_stale"],
        "dropped": dict(dropped),
        "abnormal_turns": turn_counts(batch),
        "tool_call_errors": tool_call_counts(batch),
        "masked_turns": int(sum(masked_turns(t, abnormal).sum() for t in batch)),
        "finish_reasons": finish_counts(batch),
        "rejected": counters["rejected"],
        "rejected_by": dict(rejected_by),  # refused trajectories by reason, cumulative
        "quarantine_evicted": counters["quarantine_evicted"],
        "reward_mean": float(np.mean([t.reward for t in batch])),
        "resolved_rate": float(np.mean([t.resolved for t in batch])),
        "staleness_max": int(max(stale)) if stale else 0,
        "staleness_mean": float(np.mean(stale)) if stale else 0.0,
        "staleness_counts": {str(s): stale.count(s) for s in sorted(set(stale))},  # trajectories by staleness
        "versions_in_batch": sorted({int(v) for t in batch for v in np.unique(t.versions[t.loss_mask.astype(bool)])}),
        "tokens": int(sum(t.num_tokens for t in batch)),
        # mean sampler log-prob of the sampled tokens: minus a Monte-Carlo estimate of the
        # sampling distribution's entropy per token (nats); rises toward 0 as RL sharpens the policy
        "sampled_logprob_mean": float(np.mean(lp)) if (lp := np.concatenate(
            [t.logprobs[t.loss_mask.astype(bool)] for t in batch])).size else 0.0,
        "turns_mean": float(np.mean([t.turn_offsets.shape[0] for t in batch])),
        "queue_depth": queue_depth,
        "by_agent": agent_split(batch),
    }


def agent_split(batch: list[Trajectory]) -> dict[str, dict[str, Any]]:
    """The batch's outcomes per agent that drove its episodes (``Trajectory.agent``: a ``rollout.agent``
    name), in name order: ``trajectories``, ``reward_mean``, ``resolved_rate``, ``turns_mean`` (sampled
    turns per trajectory), ``tokens`` (the streams' tokens, all), ``history_breaks`` (segments that ended
    because the agent broke its history, ``finish_reason`` ``history_break``) and ``template_mismatches``.
    Agents with no trajectory in the batch are absent."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({t.agent for t in batch}):
        ts = [t for t in batch if t.agent == name]
        out[name] = {"trajectories": len(ts), "reward_mean": float(np.mean([t.reward for t in ts])),
                     "resolved_rate": float(np.mean([t.resolved for t in ts])),
                     "turns_mean": float(np.mean([t.turn_offsets.shape[0] for t in ts])),
                     "tokens": int(sum(t.num_tokens for t in ts)),
                     "history_breaks": sum(t.finish_reason == HISTORY_BREAK for t in ts),
                     "template_mismatches": int(sum(t.template_mismatches for t in ts))}
    return out


def merge_agent_splits(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The ``by_agent`` parts of several metrics rows as one (:func:`agent_split`'s keys): counts summed,
    means weighted by each row's trajectories of that agent. Rows without ``by_agent`` (written before it
    existed) are skipped."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        for name, a in (row.get("by_agent") or {}).items():
            m = out.setdefault(name, {"trajectories": 0, "reward_mean": 0.0, "resolved_rate": 0.0, "turns_mean": 0.0,
                                      "tokens": 0, "history_breaks": 0, "template_mismatches": 0})
            n, k = m["trajectories"], a["trajectories"]
            for key in ("reward_mean", "resolved_rate", "turns_mean"):
                m[key] = (m[key] * n + a[key] * k) / (n + k) if n + k else 0.0
            for key in ("trajectories", "tokens", "history_breaks", "template_mismatches"):
                m[key] += a[key]
    return dict(sorted(out.items()))


class MetricsFile:
    """``metrics.jsonl`` at ``path``, appended one whole row per step.

    Args:
        path: the file (created on the first write).
        disk: the run directory's guard: an OSError it calls a disk fault keeps the rows for later.
    """

    def __init__(self, path: Path, disk: DiskGuard):
        self.path, self.disk = path, disk
        self.unwritten: list[str] = []  # rows a full disk refused, written later

    def write(self, metrics: dict[str, Any]) -> None:
        """Stamp ``metrics`` with ``time`` (Unix seconds), append it (:meth:`flush`) and log its summary line."""
        metrics["time"] = time.time()
        self.unwritten.append(json.dumps(metrics) + "\n")
        self.flush()
        logger.info("step {step} v{version}: reward {reward_mean:.2f} resolved {resolved_rate:.2f} "
                    "staleness max {staleness_max} |dlogp| {logprob_diff_mean:.4f} {tokens_per_s:.0f} tok/s", **metrics)

    def flush(self) -> bool:
        """Append the rows not yet in the file, whole; a full disk keeps them for the next try
        (logged). Returns whether none waits.

        Raises:
            OSError: a write error that is not a disk fault (:meth:`DiskGuard.fault`).
        """
        if not self.unwritten:
            return True
        try:
            append_whole(self.path, "".join(self.unwritten).encode())
        except OSError as e:
            if not self.disk.fault(e, self.path):
                raise
            logger.error("metrics.jsonl: {} rows wait for disk space ({})", len(self.unwritten), e)
            return False
        self.unwritten.clear()
        return True

    def trim(self, step: int) -> None:
        """Drop the rows past ``step`` (a resume from the checkpoint of ``step``).

        The kept rows go to a new file that replaces the old one (t1async/fileio.py ``replace_file``): a reader that
        tails the file (the launch's :class:`t1async.service.service.MetricsTail`) sees a new
        inode and starts over, never the middle of a rewritten row, and a learner killed during
        the trim leaves the old file whole. A line that is not a JSON row (none is written so) is
        kept where its step cannot be read, so nothing is dropped unseen.
        """
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                row_step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                logger.warning("metrics.jsonl: a line that is not a metrics row is kept as it is: {!r}", line[:80])
                kept.append(line)
                continue
            if row_step <= step:
                kept.append(line)
        replace_file(self.path, "".join(r + "\n" for r in kept))
