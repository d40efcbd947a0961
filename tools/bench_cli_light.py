"""``t1async bench cli-light``: how long ``t1async status``, ``scale`` and ``stop`` take, beside importing torch.

Prints ONE JSON object. This process holds a run directory and answers its control socket (the real
:class:`~t1async.service.control.ControlServer` with canned replies: the client side is what is
measured, a launch answers in milliseconds); each command runs ``--rounds`` times as a new
interpreter (``python -m t1async.cli ...``), alternating with ``python -c "import torch"`` (what
``status`` paid before it imported only its own module), so a load change moves both. Reported per
command: the median wall seconds and the modules among torch, ray, numpy, transformers the command
imported; ``torch_import_s``: the median of the torch imports; ``load``: the 1-minute load average
before and after.

Usage: ``t1async bench cli-light [--rounds 5]``.
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

from t1async.service.control import ControlServer
from t1async.service.rundir import RunDirLock

PROBE = ("import json, runpy, sys; sys.argv = ['t1async', *sys.argv[1:]]\n"
         "try:\n    runpy.run_module('t1async.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
         "print(json.dumps([m for m in ('torch', 'ray', 'numpy', 'transformers') if m in sys.modules]))")


def timed(argv: list[str]) -> tuple[float, str]:
    """Wall seconds of ``argv`` run to completion, and its last line of stdout."""
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{argv} exited {out.returncode}: {out.stderr[-500:]}")
    return time.perf_counter() - t0, (out.stdout.strip().splitlines() or [""])[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="t1async-cli-light-"))
    lock = RunDirLock(run_dir)
    status = {"ok": True, "run_dir": str(run_dir), "state": "running", "step": 1, "version": 0, "max_steps": 0,
              "actors": [], "samplers": []}
    server = ControlServer("127.0.0.1", {"status": lambda r: status, "stop": lambda r: {"ok": True},
                                         "scale": lambda r: {"ok": True, "applied": r["changes"]}})
    lock.write(control=server.address)
    commands = {"status": ["status", str(run_dir)], "status --json": ["status", str(run_dir), "--json"],
                "scale": ["scale", str(run_dir), "rollout.num_actors=2"]}
    load0 = os.getloadavg()[0]
    times: dict[str, list[float]] = {k: [] for k in [*commands, "torch_import"]}
    imported: dict[str, list[str]] = {}
    try:
        for _ in range(args.rounds):
            for name, argv in commands.items():
                s, last = timed([sys.executable, "-c", PROBE, *argv])
                times[name].append(s)
                imported[name] = json.loads(last)
            times["torch_import"].append(timed([sys.executable, "-c", "import torch"])[0])
    finally:
        server.close()
        lock.release()
    print(json.dumps({"rounds": args.rounds, "load": [round(load0, 1), round(os.getloadavg()[0], 1)],
                      "torch_import_s": round(statistics.median(times.pop("torch_import")), 2),
                      "commands": {k: {"median_s": round(statistics.median(v), 2), "imported": imported[k]}
                                   for k, v in times.items()}}))


if __name__ == "__main__":
    main()
