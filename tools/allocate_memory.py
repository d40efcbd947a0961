"""Take this node's memory, a chunk at a time, until Ray's memory monitor kills a role of a running
service, then give it all back: the operator's recipe for watching the service survive the monitor
(docs/operations.md, "Ray's memory monitor"; tests/e2e/test_service_pressure.py does the same).

Two steps, one command each::

    python tools/allocate_memory.py threshold [--headroom-mb 3500]
        prints the RAY_memory_usage_threshold to launch with: the fraction of memory in use now
        plus the headroom (room for the launch itself), at most 0.95 (Ray's default)
    python tools/allocate_memory.py until-killed RUN_DIR [--chunk-mb 128] [--max-mb 6144] [--every-s 0.5]
        allocates (and touches) --chunk-mb every --every-s seconds, at most --max-mb, while it asks
        the service (``t1async status``'s control request) whether Ray's memory monitor has killed
        a role; as soon as one was, it frees everything and prints one JSON object: ``allocated_mb``,
        ``memory_kills``, ``restarts``, ``step`` and the status's ``memory`` line. Exit status 0 when a
        kill was seen, 1 when --max-mb was reached without one (memory freed all the same).

Only run it on a node where taking that much memory hurts no one else: it stops at --max-mb
whatever happens, and gives the memory back at exit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from t1async.service.control import ControlError, request
from t1async.service.memory import node_memory_used


def threshold(headroom_mb: float, meminfo: Path = Path("/proc/meminfo")) -> float:
    """``RAY_memory_usage_threshold`` that leaves ``headroom_mb`` above the memory in use now (at most 0.95)."""
    total_mb = int(meminfo.read_text().split()[1]) / 1024
    used = node_memory_used(meminfo)
    if used is None:
        raise SystemExit("allocate_memory: error: /proc/meminfo is unreadable")
    return round(min(0.95, used + headroom_mb / total_mb), 3)


def killed(run_dir: str) -> dict | None:
    """The status when Ray's memory monitor has killed a role of the service in ``run_dir`` (or a
    role was restarted), else None; None too while the service does not answer."""
    try:
        st = request(run_dir, {"cmd": "status"}, timeout_s=10)
    except ControlError:
        return None
    r, m = st.get("restarts") or {}, st.get("memory") or {}
    return st if (m.get("memory_kills") or r.get("controller") or r.get("learner") or r.get("samplers")) else None


def until_killed(run_dir: str, chunk_mb: int, max_mb: int, every_s: float) -> int:
    chunks: list[bytearray] = []
    st = None
    while (st := killed(run_dir)) is None and len(chunks) * chunk_mb < max_mb:
        chunks.append(bytearray(chunk_mb << 20))  # (zero-filled: every page is touched)
        print(f"allocated {len(chunks) * chunk_mb} MB, node memory in use {node_memory_used():.1%}", file=sys.stderr,
              flush=True)
        time.sleep(every_s)
    allocated = len(chunks) * chunk_mb
    chunks.clear()  # given back at once
    st = st or killed(run_dir)
    out = {"allocated_mb": allocated, "killed": st is not None}
    if st is not None:
        out.update({"memory_kills": st["memory"].get("memory_kills"), "restarts": st.get("restarts"),
                    "step": st.get("step"), "memory": st["memory"].get("line")})
    print(json.dumps(out))
    return 0 if st is not None else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("threshold", help="the RAY_memory_usage_threshold to launch with")
    t.add_argument("--headroom-mb", type=float, default=3500.0)
    u = sub.add_parser("until-killed", help="allocate until Ray's memory monitor kills a role of RUN_DIR's service")
    u.add_argument("run_dir")
    u.add_argument("--chunk-mb", type=int, default=128)
    u.add_argument("--max-mb", type=int, default=6144)
    u.add_argument("--every-s", type=float, default=0.5)
    args = p.parse_args(argv)
    if args.cmd == "threshold":
        print(threshold(args.headroom_mb))
        return 0
    return until_killed(args.run_dir, args.chunk_mb, args.max_mb, args.every_s)


if __name__ == "__main__":
    sys.exit(main())
