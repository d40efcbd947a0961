"""``t1async bench transport``: raw ZeroMQ throughput vs the full trajectory path, side by side.

Prints ONE JSON object. For each case, rounds alternate (the machine is shared and noisy) between

- raw: a DEALER process sends frames of the encoded trajectory's size to a ROUTER (zero-copy on
  both ends), nothing else;
- traj: a process encodes each trajectory and hands it to :class:`ZmqSender` (spool to disk,
  window of unACKed frames) -> ROUTER -> :func:`decode` + validate -> ACK;
- traj_log (case a only): as traj, and the receiver also appends each frame to a
  :class:`ReceiveLog` (``log_fsync=never``, default 1 GiB segments, one log for the whole run)
  before the ACK, as the learner does; between rounds everything logged counts as consumed (a
  checkpoint), so from the second round on, segments are recycled as in a long run.

Throughput = bytes received after the first ``warmup`` messages / the time from the arrival of
message ``warmup`` to the last (steady state, as a service runs for days: the sender's spool
files exist and are reused; the same messages are skipped for raw and traj); the median of the
rounds is reported. ``ratio`` is the median over rounds of traj / raw measured back to back in
the same round (paired, so a load change between rounds moves both); ``ratio_of_medians`` is
median(traj) / median(raw) over all rounds, printed beside it. ``cpu_us_per_message``: the median
CPU microseconds per steady-state message of each end (sender process, receiving process) and of
both, per kind; ``cpu_bound_ratio`` = raw / traj of both ends' CPU (what the ratio would be if CPU
alone limited both). ``decode_us`` is the median CPU time (thread time) to decode and
validate one case-a frame already in memory (the copy off the socket excluded).

Cases: (a) 32k tokens, 48 layers, top-8, 128 experts; (b) 4k tokens, 4 layers, top-2, 8 experts.
Usage: ``t1async bench transport [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from t1async.cli import OneLineErrors, at_least_one
from t1async.trajectory import EncodedTrajectory, Trajectory, decode, encode, experts_dtype
from t1async.transport.delivery import ReceiveLog
from t1async.transport.transport import PROTOCOL, ZmqReceiver, ZmqSender

CASES = {"a": dict(T=32768, layers=48, top_k=8, experts=128, n=64, warmup=24),
         "b": dict(T=4096, layers=4, top_k=2, experts=8, n=800, warmup=200)}


def make(T: int, layers: int, top_k: int, experts: int, turns: int = 100, seed: int = 0) -> Trajectory:
    """A realistic trajectory: ``turns`` sampled spans between observations, random ids and experts."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(T, np.uint8)
    edges = np.linspace(T // 16, T, turns + 1).astype(int)
    spans = [(int(edges[i]) + (edges[i + 1] - edges[i]) // 2, int(edges[i + 1])) for i in range(turns)]
    for s, e in spans:
        mask[s:e] = 1
    return Trajectory(task="bench", actor_id=0, token_ids=rng.integers(0, 151_000, T).astype(np.uint32), loss_mask=mask,
                      logprobs=np.where(mask == 1, -rng.random(T), 0).astype(np.float32),
                      versions=np.where(mask == 1, 7, -1).astype(np.int32), turn_offsets=np.array(spans, np.int32),
                      routed_experts=((rng.integers(0, experts, (T - 1, layers, 1)) + np.arange(top_k))
                                      % experts).astype(experts_dtype(experts)),  # top-k distinct per row
                      num_experts=experts, reward=3.0, passed=3, total=4, resolved=False, finish_reason="end_signal",
                      tests=[(f"test_{i}", i < 3) for i in range(4)], started_at=1.0, finished_at=2.0)


def sender_main(kind: str, endpoint: str, case: str, n: int, spool: str) -> None:
    """Child process: send ``n`` messages of ``case`` as ``kind`` (raw or traj), then wait for ACKs."""
    c = CASES[case]
    traj = make(c["T"], c["layers"], c["top_k"], c["experts"])
    if kind == "raw":
        frame = encode(traj)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 8)
        sock.connect(endpoint)
        for i in range(n):
            sock.send_multipart([PROTOCOL, f"raw-{i}".encode(), frame], copy=False)
        sock.recv()  # the receiver's "done"
        sock.close(linger=0)
        return
    tx = ZmqSender(endpoint, spool_dir=spool, window_messages=64, window_bytes=256 << 20, spool_max_messages=256)
    for i in range(n):
        traj.trajectory_id = f"traj-{os.getpid()}-{i}"  # unique across rounds (one receive log for all)
        tx.send(traj.trajectory_id, EncodedTrajectory(traj))
    tx.flush(600)
    tx.close()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def receive(kind: str, case: str, n: int, spool: str, log: ReceiveLog | None = None) -> tuple[float, float, float]:
    """Run one round; returns (bytes per second, sender CPU us per message, receiver CPU us per
    message) in the steady state (after ``warmup`` messages). ``log``: append each frame to it
    before the ACK. CPU is each process's user + system time, all threads (ZeroMQ's I/O thread,
    the sender's spool and I/O threads) included."""
    c = CASES[case]
    rx = ZmqReceiver("tcp://127.0.0.1:*", rcvhwm=8)
    child = subprocess.Popen([sys.executable, __file__, "--sender", "raw" if kind == "raw" else "traj", rx.endpoint,
                              case, str(n), spool])
    nbytes, t_first, warmup = 0, None, c["warmup"]
    try:
        for i in range(n):
            d = None
            while d is None:
                d = rx.recv(60.0)
                if d is None and child.poll() is not None:
                    raise RuntimeError(f"sender exited with {child.returncode}")
            if i == warmup:
                t_first = time.perf_counter()
                cpu0 = _cpu_s(child.pid), _cpu_s(os.getpid())
            elif i > warmup:
                nbytes += len(d.frame)
            if kind != "raw":
                decode(d.frame, num_experts=c["experts"], num_layers=c["layers"], top_k=c["top_k"], max_version=7)
                if log is not None:
                    log.append(d.key, d.frame)
                rx.ack(d, True)
        elapsed = time.perf_counter() - (t_first or 0.0)
        cpu = _cpu_s(child.pid) - cpu0[0], _cpu_s(os.getpid()) - cpu0[1]
        if kind == "raw":
            rx._sock.send_multipart([d.peer, b"done"])  # noqa: SLF001 (bench-only release of the raw sender)
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
        rx.close()
    return nbytes / elapsed, cpu[0] / (n - 1 - warmup) * 1e6, cpu[1] / (n - 1 - warmup) * 1e6


def decode_cpu_us(case: str, reps: int = 40) -> float:
    c = CASES[case]
    frame = encode(make(c["T"], c["layers"], c["top_k"], c["experts"]))
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        decode(frame, num_experts=c["experts"], num_layers=c["layers"], top_k=c["top_k"], max_version=7)
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = OneLineErrors(prog="t1async bench transport", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=at_least_one, default=5, help="alternating rounds per case (>= 1)")
    p.add_argument("--sender", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.sender:
        kind, endpoint, case, n, spool = args.sender
        sender_main(kind, endpoint, case, int(n), spool)
        return
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="t1async-bench-") as spool:
        for case in ("a", "b"):
            kinds = ["raw", "traj"] + (["traj_log"] if case == "a" else [])
            rates: dict[str, list[float]] = {k: [] for k in kinds}
            cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}  # (sender, receiver) us
            log = ReceiveLog(Path(spool) / f"log-{case}", fsync="never")  # one log for the run, as a learner has
            for _ in range(args.rounds):
                for k in kinds:
                    rate, tx_us, rx_us = receive(k, case, CASES[case]["n"], spool, log if k == "traj_log" else None)
                    rates[k].append(rate)
                    cpu[k].append((tx_us, rx_us))
                    # a checkpoint between rounds: everything received was consumed, its segments are freed
                    log.drop_consumed({key: 1 for key in log.keys()})
            log.close()
            med = {k: statistics.median(v) for k, v in rates.items()}
            paired = {k: statistics.median(t / r for t, r in zip(rates[k], rates["raw"])) for k in kinds}
            suffix = "" if case == "a" else "_b"
            out[f"raw_bytes_per_s{suffix}"] = round(med["raw"])
            out[f"traj_bytes_per_s{suffix}"] = round(med["traj"])
            out[f"ratio{suffix}"] = round(paired["traj"], 3)
            out[f"ratio_of_medians{suffix}"] = round(med["traj"] / med["raw"], 3)
            if "traj_log" in med:
                out["traj_with_log_bytes_per_s"] = round(med["traj_log"])
                out["ratio_with_log"] = round(paired["traj_log"], 3)
            total = {k: statistics.median(a + b for a, b in v) for k, v in cpu.items()}
            out[f"cpu_us_per_message{suffix}"] = {k: {"sender": round(statistics.median(a for a, _ in v)),
                                                      "receiver": round(statistics.median(b for _, b in v)),
                                                      "both": round(total[k])} for k, v in cpu.items()}
            out[f"cpu_bound_ratio{suffix}"] = round(total["raw"] / total["traj"], 3)
            out[f"decode_us{suffix}"] = round(decode_cpu_us(case), 1)
            c = CASES[case]
            out[f"frame_bytes{suffix}"] = len(encode(make(c["T"], c["layers"], c["top_k"], c["experts"])))
            out[f"rounds{suffix}"] = {k: [round(x) for x in v] for k, v in rates.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
