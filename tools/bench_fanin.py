"""``t1async bench fanin``: N rollout actors pushing trajectories into ONE real learner receive path.

Prints ONE JSON object. Per actor count N (``--actors 16,128,512``), three kinds of process:

- learner (one subprocess): a real :class:`~t1async.actors.learner.Learner` (torch backend, the
  default local model: 4 MoE layers, top-2 of 8 experts), with its receive thread as in a run:
  ROUTER -> de-duplicate by trajectory id -> decode + validate -> receive log (``log_fsync``
  as configured, default ``always``) -> ACK -> its bounded decoded queue (the admission window
  of the learner's memory: ``recv_queue_messages``/``recv_queue_bytes``). No training: a consumer
  thread takes each trajectory off that queue at once (an infinitely fast trainer), so what is
  measured is the receive path alone. It samples its own CPU time, RSS and counters every 0.1 s.
- actors (``--procs`` subprocesses, N/procs logical actors each): every logical actor is a real
  :class:`~t1async.transport.transport.ZmqSender` (its own DEALER socket and ZeroMQ identity, its own
  I/O thread, its own spool folder under one shared spool root, the default window and
  ``ack_timeout_s``), sending real frames (:class:`~t1async.trajectory.EncodedTrajectory`,
  ``--tokens`` tokens, 100 turns, routed experts [T-1, layers, top_k] of ``--shape``) under ids of its own stream
  (``<16 hex>-<seq>``, as :func:`~t1async.trajectory.new_trajectory_id`). Processes, not
  threads of one: 512 senders' I/O threads in one interpreter would measure the GIL; 512
  processes would not fit 2 cores. One driver thread per process hands trajectories to its
  actors without ever blocking in ``send`` (a busy actor is skipped, as a real one is busy with
  its next episode).

Two phases per N, back to back in the same processes:

1. ``saturated`` (``--seconds``): each actor keeps ``--depth`` trajectories unACKed (an actor
   whose episodes finish faster than the learner takes them). Ingest rate (trajectories/s,
   MB/s), learner CPU per trajectory and ACK latency are taken after ``--warmup-s``.
2. ``paced`` (``--seconds``): each actor sends one trajectory per ``interval``, chosen so that
   the offered load is ``--paced-frac`` of what its process saw ACKed in phase 1 (normal
   operation below saturation); ACK latency p50/p99 of that phase.

ACK latency: from the moment the actor calls ``send`` (spool write included) to the moment its
I/O thread receives the ACK (``ZmqSender(on_ack=...)``). After both phases every actor flushes;
lost = ids sent that the learner's queue never delivered; duplicated = ids delivered more than once.
Memory: the learner's peak RSS (VmHWM) and its rise over the RSS before the first message; the
trajectory bytes it may hold by design: the decoded queue (``recv_queue_messages`` frames) plus
ZeroMQ's per-connection receive queues (``rcvhwm`` messages per actor: they grow with N), and what the
actors have in flight (``--depth`` each here; in a run at most the admission window for all).

Group commit: the learner stores every message already waiting on its socket with one flush of
the receive log before it ACKs them (``transport.log_group_messages``, default 64). At
``--compare-group-at`` actors (default 128) the bench also runs the same N with a flush per
trajectory (``log_group_messages=1``, the receive path before group commit), right after, and
prints ``group_commit_speedup`` (saturated ingest, grouped / per trajectory).

Check mode (``--messages M``): every actor sends exactly M trajectories in one closed-loop phase, no
clock; only the counts (sent, delivered, lost, duplicated, unACKed) are meaningful (the test of this bench
runs it so).

Usage: ``t1async bench fanin [--actors 16,128,512] [--seconds 8] [--tokens 4096] [--procs 4]
[--shape 4,2,8] [--log-fsync always] [--group 64] [--compare-group-at 128] [--messages M]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transport import _cpu_s, make  # noqa: E402  (tools/ is not a package)

from t1async.cli import OneLineErrors, at_least_one  # noqa: E402

HERE = Path(__file__).resolve()
LOCAL_SHAPE = [4, 2, 8]  # MoE layers, experts per token, experts of the default local model


def _rss_kb(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# ---- learner process --------------------------------------------------------------------
def learner_main(spec: dict[str, Any]) -> None:
    """Child: a real Learner whose receive thread runs; prints its endpoint, then serves until
    stdin says ``stop``; writes ``spec['out']`` (consumed ids, counters, samples)."""
    import torch  # noqa: F401  (imported before the samples start: its RSS is the baseline's)

    from t1async.actors.learner import Learner
    from t1async.config import LearnerConfig, ModelConfig, TransportConfig, WeightSyncConfig

    transport = TransportConfig(curve=False, log_fsync=spec["log_fsync"], rcvhwm=spec["rcvhwm"], log_group_messages=spec["group"])
    layers, top_k, experts = spec["shape"]
    # the routed-expert shape the frames carry; a tiny width keeps a 48-layer, 128-expert model small
    model = ModelConfig() if spec["shape"] == LOCAL_SHAPE else ModelConfig(
        num_hidden_layers=layers, num_experts_per_tok=top_k, num_experts=experts, hidden_size=16,
        moe_intermediate_size=16)
    learner = Learner(LearnerConfig(max_steps=0, episodes_per_step=0), model, transport, WeightSyncConfig(),
                      spec["run_dir"])
    queue = learner.inbox.queue  # noqa: SLF001  (the bench consumes in place of the trainer)
    consumed: list[str] = []
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            try:
                consumed.append(queue.get(timeout=0.1).trajectory_id)
            except Exception:  # queue.Empty
                continue

    samples: list[list[float]] = []

    def sample() -> None:
        while not stop.is_set():
            samples.append([time.time(), learner.counters["received"], _cpu_s(os.getpid()), _rss_kb() / 1024,
                            learner.inbox.queue.nbytes])  # noqa: SLF001
            time.sleep(0.1)

    threads = [threading.Thread(target=consume, daemon=True), threading.Thread(target=sample, daemon=True)]
    for t in threads:
        t.start()
    baseline_mb = _rss_kb() / 1024
    print(learner.endpoint(), flush=True)
    sys.stdin.readline()  # "stop"
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join()
    out = {"consumed": consumed, "counters": dict(learner.counters), "samples": samples, "rss_baseline_mb": baseline_mb,
           "rss_peak_mb": _rss_kb("VmHWM") / 1024, "queue_messages": learner.inbox.queue.max_items}  # noqa: SLF001
    learner.close()
    Path(spec["out"]).write_text(json.dumps(out))


# ---- actor processes --------------------------------------------------------------------
def actors_main(spec: dict[str, Any]) -> None:
    """Child: ``spec['actors']`` logical actors (ZmqSender each) driven by one thread; writes
    ``spec['out']`` (per id: send time, ACK time; sender stats)."""
    import numpy as np
    import zmq

    from t1async.trajectory import EncodedTrajectory
    from t1async.transport.transport import ZmqSender

    zmq.Context.instance().set(zmq.MAX_SOCKETS, 8 * spec["actors"] + 64)  # 3 sockets per sender
    traj = make(spec["tokens"], *spec["shape"], seed=os.getpid())
    traj.versions = np.where(traj.loss_mask == 1, 0, -1).astype(np.int32)  # sampled at version 0 (the learner's)
    traj.token_ids %= 4096  # the local model's vocabulary
    acked: dict[str, float] = {}
    sent: dict[str, tuple[float, int]] = {}  # id -> (send time, phase)

    def on_ack(key: str, ok: bool, reason: str) -> None:
        acked[key] = time.time()

    senders = [ZmqSender(spec["endpoint"], spool_dir=spec["spool"], on_ack=on_ack) for _ in range(spec["actors"])]
    streams = [uuid.uuid4().hex[:16] for _ in senders]
    seqs = [0] * len(senders)

    def send(i: int, phase: int) -> None:
        traj.trajectory_id = f"{streams[i]}-{seqs[i]}"
        seqs[i] += 1
        sent[traj.trajectory_id] = (time.time(), phase)
        senders[i].send(traj.trajectory_id, EncodedTrajectory(traj))

    print("ready", flush=True)
    t0 = float(sys.stdin.readline())  # the common start, once every process is ready
    t1, t2 = t0 + spec["seconds"], t0 + 2 * spec["seconds"]
    while time.time() < t0:
        time.sleep(0.01)
    count = spec.get("messages")  # test mode: exactly this many per actor, one phase
    while (count is None and time.time() < t1) or (count is not None and min(seqs) < count):
        busy = False
        for i, tx in enumerate(senders):
            if tx.unacknowledged() < spec["depth"] and (count is None or seqs[i] < count):
                send(i, 1)
                busy = True
        if not busy:
            time.sleep(0.002)
    if count is None:  # phase 2: paced at a fraction of what this process saw ACKed in phase 1
        warm = t0 + spec["warmup_s"]
        rate = sum(1 for k, (ts, _) in sent.items() if warm <= acked.get(k, 0) <= t1) / max(t1 - warm, 1e-3)
        interval = len(senders) / max(spec["paced_frac"] * rate, 1e-3)
        due = [t1 + interval * (i + 0.5) / len(senders) for i in range(len(senders))]  # staggered
        while time.time() < t2:
            now = time.time()
            for i, tx in enumerate(senders):
                if now >= due[i] and tx.unacknowledged() < tx.spool_max_messages:
                    send(i, 2)
                    due[i] += interval
            time.sleep(0.002)
    flushed = all(tx.flush(120.0) for tx in senders)
    stats = {k: sum(getattr(tx.stats, k) for tx in senders) for k in ("sent", "resent", "acked", "rejected")}
    for tx in senders:
        tx.close()
    Path(spec["out"]).write_text(json.dumps({"sent": sent, "acked": acked, "stats": stats, "flushed": flushed,
                                             "cpu_s": _cpu_s(os.getpid())}))


# ---- driver -----------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_fanin(actors: int, *, seconds: float = 8.0, warmup_s: float = 2.0, tokens: int = 4096, procs: int = 4,
              depth: int = 2, paced_frac: float = 0.5, log_fsync: str = "always", rcvhwm: int = 64,
              shape: list[int] = LOCAL_SHAPE, group: int = 64, messages: int | None = None,
              workdir: str | None = None) -> dict[str, Any]:
    """Run one fan-in measurement (see the module docstring) and return its figures.

    ``messages``: test mode: every actor sends exactly this many (one closed-loop phase), and
    only the counts are meaningful. Raises RuntimeError if a child process fails.
    """
    with tempfile.TemporaryDirectory(prefix="t1async-fanin-", dir=workdir) as tmp:
        lspec = {"run_dir": f"{tmp}/run", "out": f"{tmp}/learner.json", "log_fsync": log_fsync, "rcvhwm": rcvhwm,
                 "shape": list(shape), "group": group}
        learner = subprocess.Popen([sys.executable, str(HERE), "--child", "learner", json.dumps(lspec)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        children: list[subprocess.Popen] = []
        try:
            endpoint = learner.stdout.readline().strip()
            if not endpoint:
                raise RuntimeError(f"the learner process exited with {learner.wait()}")
            procs = max(1, min(procs, actors))
            specs = [{"endpoint": endpoint, "spool": f"{tmp}/spool", "out": f"{tmp}/actors{p}.json",
                      "actors": actors // procs + (p < actors % procs), "tokens": tokens, "depth": depth,
                      "seconds": seconds, "warmup_s": warmup_s, "paced_frac": paced_frac,
                      "messages": messages, "shape": list(shape)} for p in range(procs)]
            children = [subprocess.Popen([sys.executable, str(HERE), "--child", "actors", json.dumps(s)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for s in specs]
            for c in children:
                if c.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"an actor process exited with {c.wait()}")
            # every sender built and connecting before the clock starts (test mode: no clock)
            t0 = time.time() + (0.0 if messages is not None else 0.5 + actors / 500)
            for c in children:
                c.stdin.write(f"{t0}\n")
                c.stdin.flush()
            for c in children:
                if c.wait(timeout=seconds * 2 + 300) != 0:
                    raise RuntimeError(f"an actor process exited with {c.returncode}")
            learner.stdin.write("stop\n")
            learner.stdin.flush()
            if learner.wait(timeout=60) != 0:
                raise RuntimeError(f"the learner process exited with {learner.returncode}")
        finally:
            for c in [learner, *children]:
                if c.poll() is None:
                    c.kill()
        lrn = json.loads(Path(lspec["out"]).read_text())
        acts = [json.loads(Path(s["out"]).read_text()) for s in specs]
    sent = {k: v for a in acts for k, v in a["sent"].items()}
    acked = {k: v for a in acts for k, v in a["acked"].items()}
    consumed = lrn["consumed"]
    frame_bytes = len(__import__("t1async.trajectory", fromlist=["encode"]).encode(make(tokens, *shape)))
    out: dict[str, Any] = {
        "actors": actors, "actor_processes": procs, "frame_bytes": frame_bytes, "log_group_messages": group,
        "sent": len(sent), "delivered": len(consumed), "lost": len(set(sent) - set(consumed)),
        "duplicated": len(consumed) - len(set(consumed)), "unknown": len(set(consumed) - set(sent)),
        "unacked": len(set(sent) - set(acked)), "all_flushed": all(a["flushed"] for a in acts),
        "resent": sum(a["stats"]["resent"] for a in acts), "learner_counters": lrn["counters"],
        "rss_baseline_mb": round(lrn["rss_baseline_mb"], 1), "rss_peak_mb": round(lrn["rss_peak_mb"], 1),
    }
    rise = lrn["rss_peak_mb"] - lrn["rss_baseline_mb"]
    out["rss_rise_mb"] = round(rise, 1)
    queue_mb = lrn["queue_messages"] * frame_bytes / 2**20
    out["design_bound_mb"] = {"decoded_queue": round(queue_mb, 1),
                              "zmq_receive_queues": round(actors * rcvhwm * frame_bytes / 2**20, 1)}
    # what the actors may have in flight (sent, unACKed) is their depth (here) or window (in general)
    # each; in a run, admission control caps it for all actors together at (eta + 1) x R trajectories
    out["design_bound_mb"]["in_flight"] = round(actors * depth * frame_bytes / 2**20, 1)
    out["rise_within_decoded_queue"] = rise <= queue_mb + 32  # 32 MB: allocator and socket slack
    out["rise_within_queue_plus_in_flight"] = rise <= queue_mb + out["design_bound_mb"]["in_flight"] + 32
    if messages is not None:
        return out
    s = lrn["samples"]

    def window(lo: float, hi: float) -> tuple[list[float], list[float]]:
        inside = [r for r in s if lo <= r[0] <= hi]
        return inside[0], inside[-1]

    a, b = window(t0 + warmup_s, t0 + seconds)
    rate = (b[1] - a[1]) / (b[0] - a[0])
    lat = {p: [acked[k] - ts for k, (ts, ph) in sent.items() if ph == p and k in acked
               and ts >= t0 + (p - 1) * seconds + warmup_s] for p in (1, 2)}
    pa, pb = window(t0 + seconds + warmup_s, t0 + 2 * seconds)
    out["saturated"] = {"trajectories_per_s": round(rate, 1), "mb_per_s": round(rate * frame_bytes / 2**20, 1),
                        "learner_cpu_ms_per_trajectory": round((b[2] - a[2]) / max(b[1] - a[1], 1) * 1e3, 3),
                        "learner_cpu_cores": round((b[2] - a[2]) / (b[0] - a[0]), 2),
                        "ack_p50_s": _r(_pct(lat[1], 0.5)), "ack_p99_s": _r(_pct(lat[1], 0.99)),
                        "acks_measured": len(lat[1])}
    prate = (pb[1] - pa[1]) / (pb[0] - pa[0])
    out["paced"] = {"offered_frac": paced_frac, "trajectories_per_s": round(prate, 1),
                    "learner_cpu_cores": round((pb[2] - pa[2]) / (pb[0] - pa[0]), 2),
                    "ack_p50_s": _r(_pct(lat[2], 0.5)), "ack_p99_s": _r(_pct(lat[2], 0.99)), "acks_measured": len(lat[2])}
    out["actor_cpu_s"] = round(sum(a["cpu_s"] for a in acts), 1)
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def main() -> None:
    p = OneLineErrors(prog="t1async bench fanin", description=__doc__.splitlines()[0])
    p.add_argument("--actors", default="16,128,512", help="actor counts, comma-separated (each >= 1)")
    p.add_argument("--seconds", type=float, default=8.0, help="seconds of each phase (saturated, paced)")
    p.add_argument("--warmup-s", type=float, default=2.0, help="seconds of each phase left out of the figures")
    p.add_argument("--tokens", type=at_least_one, default=4096, help="tokens per trajectory")
    p.add_argument("--procs", type=at_least_one, default=4, help="actor processes (actors are spread over them)")
    p.add_argument("--depth", type=at_least_one, default=2, help="unACKed trajectories per actor when saturated")
    p.add_argument("--paced-frac", type=float, default=0.5, help="offered load of the paced phase, x saturated")
    p.add_argument("--log-fsync", default="always", choices=("always", "never"), help="learner receive-log fsync")
    p.add_argument("--rcvhwm", type=at_least_one, default=64, help="learner ZeroMQ receive HWM per connection")
    p.add_argument("--shape", default="4,2,8", help="routed experts: MoE layers,top_k,experts (48,8,128: Qwen3-30B-A3B)")
    p.add_argument("--group", type=at_least_one, default=64, help="learner transport.log_group_messages")
    p.add_argument("--compare-group-at", type=int, default=128,
                   help="also run this actor count with a receive-log flush per trajectory (0: skip)")
    p.add_argument("--messages", type=at_least_one, default=None,
                   help="check mode: every actor sends exactly this many (one closed-loop phase, no timing; "
                        "only the counts are meaningful)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        (learner_main if args.child[0] == "learner" else actors_main)(json.loads(args.child[1]))
        return
    try:
        counts = [int(x) for x in args.actors.split(",")]
        assert counts and min(counts) >= 1
    except (ValueError, AssertionError):
        p.error(f"--actors {args.actors!r}: give actor counts >= 1, comma-separated, e.g. 16,128,512")
    try:
        shape = [int(x) for x in args.shape.split(",")]
        assert len(shape) == 3 and min(shape) >= 1 and shape[1] <= shape[2]
    except (ValueError, AssertionError):
        p.error(f"--shape {args.shape!r}: give layers,top_k,experts (integers >= 1, top_k <= experts), e.g. 48,8,128")
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    kw = dict(seconds=args.seconds, warmup_s=args.warmup_s, tokens=args.tokens, procs=args.procs, depth=args.depth,
              paced_frac=args.paced_frac, log_fsync=args.log_fsync, rcvhwm=args.rcvhwm, shape=shape,
              messages=args.messages)
    runs = []
    for n in counts:
        runs.append(run_fanin(n, group=args.group, **kw))
        if n == args.compare_group_at and args.group > 1 and args.log_fsync == "always" and args.messages is None:
            # the same N at once with a flush per trajectory (the receive path before group commit)
            single = run_fanin(n, group=1, **kw)
            runs[-1]["per_trajectory_flush"] = {"saturated": single["saturated"], "lost": single["lost"],
                                                "duplicated": single["duplicated"]}
            runs[-1]["group_commit_speedup"] = round(
                runs[-1]["saturated"]["trajectories_per_s"] / max(single["saturated"]["trajectories_per_s"], 1e-9), 2)
    print(json.dumps({"log_fsync": args.log_fsync, "tokens": args.tokens, "shape": shape, "depth": args.depth,
                      "cpus": os.cpu_count(), "runs": runs}))


if __name__ == "__main__":
    main()
