"""Environment subcommands of the ``t1async`` CLI: ``eval``, ``synth``, ``decontam``.

Registered by :func:`register` (one entry in :data:`t1async.cli.SUBCOMMANDS`); the core package
reaches the environment layer only through this registrar (see tests/test_architecture.py).

    t1async eval --tasks DIR --agent oracle|noop|policy:CHECKPOINT [--concurrency N] [--out FILE.json]
                 [--sandbox local|modal] [--config YAML]
    t1async synth --family NAME --n N --out DIR [--seed S] [--no-validate] [--jobs N]
    t1async decontam --train DIR --benchmark DIR [--config YAML] [--ngram N] [--threshold F] [--drop]
                     [--out FILE.json]

Exit status: 0 on success; ``eval`` 0 even when tasks fail (the table says so), ``synth`` 1 when a
generated task does not validate, ``decontam`` 1 when training tasks were flagged and kept (not
dropped); 2 for bad input (one ``t1async: error:`` line).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``eval``, ``synth`` and ``decontam`` parsers."""
    p = sub.add_parser("eval", help="run every task under a folder with an agent; per-task tests passed")
    p.add_argument("--tasks", required=True, help="folder of task folders (Terminal-Bench 2 or 1 layout)")
    p.add_argument("--agent", required=True, help="oracle, noop or policy:CHECKPOINT_DIR")
    p.add_argument("--concurrency", type=int, default=1, help="tasks run at once (each in its own sandbox)")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--sandbox", default="local", help="sandbox backend: local or modal")
    p.add_argument("--config", help="YAML config (env/generation/sampler sections for policy:)")
    p.set_defaults(func=run_eval)

    p = sub.add_parser("synth", help="generate training tasks from a parametrized family")
    p.add_argument("--family", required=True, help="task family (see t1async.envs.synth.FAMILIES)")
    p.add_argument("--n", type=int, required=True, help="number of tasks")
    p.add_argument("--out", required=True, help="folder to write the task folders into")
    p.add_argument("--seed", type=int, default=0, help="seed (the same seed gives the same tasks)")
    p.add_argument("--no-validate", action="store_true", help="skip the oracle/no-op validation")
    p.add_argument("--jobs", type=int, default=2, help="tasks validated in parallel")
    p.set_defaults(func=run_synth)

    p = sub.add_parser("decontam", help="flag training tasks whose text overlaps a benchmark (n-grams)")
    p.add_argument("--train", required=True, help="folder of training task folders")
    p.add_argument("--benchmark", required=True, help="folder of benchmark task folders")
    p.add_argument("--config", help="YAML config whose env.decontam_ngram / env.decontam_threshold apply")
    p.add_argument("--ngram", type=int, help="override env.decontam_ngram")
    p.add_argument("--threshold", type=float, help="override env.decontam_threshold")
    p.add_argument("--drop", action="store_true", help="delete the flagged training task folders")
    p.add_argument("--out", help="write the JSON report here")
    p.set_defaults(func=run_decontam)


def _quiet() -> None:
    """Only warnings and errors on stderr: the table is the output."""
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")


def run_eval(args: argparse.Namespace) -> int:
    """``t1async eval``: print the table; write the JSON report with ``--out``."""
    from .evaluate import evaluate, format_table, report_json

    _quiet()
    rows = evaluate(args.tasks, args.agent, concurrency=args.concurrency, sandbox=args.sandbox, config=args.config)
    print(format_table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(report_json(rows, args.agent), indent=2) + "\n")
        print(f"report written to {args.out}")
    return 0


def run_synth(args: argparse.Namespace) -> int:
    """``t1async synth``: write the tasks, validate them (oracle resolves, no-op does not)."""
    from concurrent.futures import ThreadPoolExecutor

    from .synth import synthesize
    from .task import load_task
    from .terminal import validate_task

    _quiet()
    try:
        paths = synthesize(args.family, args.n, args.out, seed=args.seed)
    except ValueError as exc:
        print(f"t1async: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(paths)} {args.family} tasks to {args.out}")
    if args.no_validate:
        return 0
    with tempfile.TemporaryDirectory(prefix="t1async-synth-") as tmp:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            reports = list(pool.map(lambda p: validate_task(load_task(p), Path(tmp)), paths))
    bad = [r for r in reports if not r.ok]
    for r in bad:
        print(f"  INVALID {r.name}: {r.error or f'oracle {r.oracle and r.oracle.passed}/{r.oracle and r.oracle.total}, noop resolved={r.noop and r.noop.resolved}'}")
    print(f"validated: {len(reports) - len(bad)}/{len(reports)} ok (oracle resolves, no-op does not)")
    return 1 if bad else 0


def run_decontam(args: argparse.Namespace) -> int:
    """``t1async decontam``: report (and with ``--drop`` delete) overlapping training tasks."""
    from t1async.config import load_config

    from .decontam import decontaminate, format_report

    _quiet()
    env = load_config(args.config).env
    n = args.ngram or env.decontam_ngram
    threshold = args.threshold if args.threshold is not None else env.decontam_threshold
    rows = decontaminate(args.train, args.benchmark, n=n, threshold=threshold, drop=args.drop)
    print(format_report(rows, threshold, n))
    if args.out:
        doc = {"ngram": n, "threshold": threshold, "tasks": [asdict(r) for r in rows],
               "flagged": sum(r.flagged for r in rows), "dropped": sum(r.dropped for r in rows)}
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if any(r.flagged and not r.dropped for r in rows) else 0
