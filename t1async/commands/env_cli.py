"""Environment subcommands of the ``t1async`` CLI: ``eval``, ``synth``, ``decontam``.

Registered by :func:`register` (one entry in :data:`t1async.cli.SUBCOMMANDS`); like every command it sits
above the environments it drives (``t1async.envs``; the layer table in tests/house/test_architecture.py).

    t1async eval --tasks DIR --agent oracle|noop|policy:CHECKPOINT [--concurrency N] [--out FILE.json]
                 [--sandbox auto|local|container|modal] [--config YAML] [--logs DIR]
                 [--network harness|task|on|off] [--agent-processes keep|kill]
    t1async images bootstrap [--tasks DIR] [--name IMAGE ...] [--rebuild] [--config YAML]
    t1async synth --family NAME --n N --out DIR [--seed S] [--no-validate] [--jobs N]
    t1async decontam --train DIR --benchmark DIR [--config YAML] [--ngram N] [--threshold F] [--drop]
                     [--out FILE.json]

Exit status: 0 on success; ``eval`` 1 when any task errored (could not be loaded, was refused,
failed to build or to verify; an unresolved task is not an error), ``synth`` 1 when a generated
task does not validate, ``decontam`` 1 when training tasks were flagged and kept (not dropped) or
could not be read; 2 for bad input (one ``t1async: error:`` line, checked before any work starts,
including that ``--out`` can be written).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from loguru import logger

from t1async.commands.decontam import check_drop_folders, decontaminate, format_report
from t1async.commands.evaluate import choose_sandbox, evaluate, format_table, is_task_folder, report_json
from t1async.commands.synth import synthesize
from t1async.config import load_config
from t1async.envs.images.engine import resolve_engine
from t1async.envs.images.stand_ins import DEFAULT_BOOTSTRAP_TAGS, bootstrap
from t1async.envs.protocol import SandboxError
from t1async.envs.taskio.dockerfile import from_images
from t1async.envs.taskio.loading import load_task, task_folders
from t1async.envs.taskio.task import TaskError
from t1async.envs.terminal import validate_task

EVAL_EPILOG = ("exit status: 0 when every task ran (resolved or not), 1 when any task errored (see the error "
               "column), 2 for bad input")
SYNTH_EPILOG = "exit status: 0 on success, 1 when a generated task does not validate, 2 for bad input"
DECONTAM_EPILOG = ("exit status: 0 when no training task overlaps the benchmark (or every flagged one was dropped "
                   "with --drop), 1 when a training task is flagged and not dropped or could not be read (so was "
                   "not checked), 2 for bad input")


class UsageError(Exception):
    """Bad command-line input; reported as one ``t1async: error:`` line with exit status 2."""


def _guard(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except UsageError as exc:
            print(f"t1async: error: {exc}", file=sys.stderr)
            return 2
    return run


def check_out_file(path: str, flag: str = "--out") -> Path:
    """Check up front that the report file ``path`` can be written (before any work is done).

    The file is created (and removed again) when it does not exist; an existing file is opened
    for appending without changing it.

    Raises:
        UsageError: ``path`` is a folder, its folder does not exist, or it cannot be written.
    """
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {p} is a folder; pass a file path such as {p / 'report.json'}")
    if not p.parent.is_dir():
        raise UsageError(f"{flag} {p}: folder {p.parent} does not exist; create it first or pass another path")
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {p} cannot be written ({exc.strerror or exc}); pass a writable file path") from None
    if not existed:
        p.unlink(missing_ok=True)
    return p


def _positive_int(value: int, flag: str) -> int:
    if value < 1:
        raise UsageError(f"{flag} must be >= 1, got {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``eval``, ``synth`` and ``decontam`` parsers."""
    p = sub.add_parser("eval", help="run every task under a folder with an agent; per-task tests passed",
                       epilog=EVAL_EPILOG)
    p.add_argument("--tasks", required=True,
                   help="folder of task folders (Terminal-Bench 2 or 1 layout), or one task folder")
    p.add_argument("--agent", required=True, help="oracle, noop or policy:CHECKPOINT_DIR")
    p.add_argument("--concurrency", type=int, default=1, help="tasks run at once (each in its own sandbox; >= 1)")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--sandbox", default="auto",
                   help="sandbox backend: local, container, modal, or auto (default: local for the shipped tasks, "
                        "container for other task folders where podman or docker is installed, else local)")
    p.add_argument("--config", help="YAML config, read for every agent: env.container for the container backend, "
                                    "env/generation/sampler sections for policy: (env.network and "
                                    "env.keep_agent_processes are training's; eval has --network and --agent-processes)")
    p.add_argument("--network", default="harness", choices=["harness", "task", "on", "off"],
                   help="sandbox network: harness (default: as the benchmark's harness, TB1 tasks on, TB2 per "
                        "task.toml allow_internet), task (only where the task allows it: TB1 off), on, off; each row "
                        "says which applied")
    p.add_argument("--agent-processes", default="keep", choices=["keep", "kill"],
                   help="what the agent (or oracle) left running: keep it through the tests (default, as both "
                        "harnesses do: tests may query a server it started) or kill it first (training's "
                        "anti-tamper default, env.keep_agent_processes: false); each row says which applied")
    p.add_argument("--logs", help="folder for per-task logs: build log, commands with output, verifier output, reward "
                                  "files, timings (default: beside --out, FILE.logs/; none without --out)")
    p.set_defaults(func=_guard(run_eval))

    p = sub.add_parser("images", help="container images: `bootstrap` builds offline stand-ins for base images")
    p.add_argument("action", choices=["bootstrap"], help="bootstrap: mmdebstrap Debian root filesystems, tagged with "
                                                          "the names tasks use in FROM")
    p.add_argument("--tasks", help="also tag every FROM image of the task folders under DIR")
    p.add_argument("--name", action="append", default=[], help="image name to provide (repeatable; default: "
                                                                 "t1async.envs.images.engine.DEFAULT_BOOTSTRAP_TAGS)")
    p.add_argument("--rebuild", action="store_true", help="rebuild root filesystems that exist already")
    p.add_argument("--config", help="YAML config whose env.container section applies")
    p.set_defaults(func=_guard(run_images))

    p = sub.add_parser("synth", help="generate training tasks from a parametrized family", epilog=SYNTH_EPILOG)
    p.add_argument("--family", required=True, help="task family (see t1async.commands.synth.FAMILIES)")
    p.add_argument("--n", type=int, required=True, help="number of tasks")
    p.add_argument("--out", required=True, help="folder to write the task folders into")
    p.add_argument("--seed", type=int, default=0, help="seed (the same seed gives the same tasks)")
    p.add_argument("--no-validate", action="store_true", help="skip the oracle/no-op validation")
    p.add_argument("--jobs", type=int, default=2, help="tasks validated in parallel (>= 1)")
    p.set_defaults(func=_guard(run_synth))

    p = sub.add_parser("decontam", help="flag training tasks whose text overlaps a benchmark (n-grams)",
                       epilog=DECONTAM_EPILOG)
    p.add_argument("--train", required=True, help="folder of training task folders")
    p.add_argument("--benchmark", required=True, help="folder of benchmark task folders")
    p.add_argument("--config", help="YAML config whose env.decontam_ngram / env.decontam_threshold apply")
    p.add_argument("--ngram", type=int, help="override env.decontam_ngram (>= 1)")
    p.add_argument("--threshold", type=float, help="override env.decontam_threshold (0 < F <= 1)")
    p.add_argument("--drop", action="store_true",
                   help="delete the flagged training task folders (refused when --train and --benchmark overlap)")
    p.add_argument("--out", help="write the JSON report here")
    p.set_defaults(func=_guard(run_decontam))


def _quiet() -> None:
    """Only warnings and errors on stderr: the table is the output."""

    logger.remove()
    logger.add(sys.stderr, level="WARNING")


def run_eval(args: argparse.Namespace) -> int:
    """``t1async eval``: print the table; write the JSON report with ``--out``. 1 when a task errored."""

    _quiet()
    _positive_int(args.concurrency, "--concurrency")
    out = check_out_file(args.out) if args.out else None
    logs = Path(args.logs) if args.logs else (Path(str(out) + ".logs") if out is not None else None)
    if logs is not None:
        try:
            logs.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--logs {logs} cannot be created ({exc.strerror or exc}); pass a writable folder") from None
    sandbox, why = choose_sandbox(args.sandbox, args.tasks, args.config)
    if why and (is_task_folder(args.tasks) or any(map(is_task_folder, task_folders(args.tasks)))):  # bad input alone
        print(f"t1async: {why}", file=sys.stderr)
    rows = evaluate(args.tasks, args.agent, concurrency=args.concurrency, sandbox=sandbox, config=args.config,
                    logs=logs, network=args.network, agent_processes=args.agent_processes)
    print(format_table(rows))
    if logs is not None:
        print(f"per-task logs in {logs}")
    if out is not None:
        try:
            settings = {"network": args.network, "agent_processes": args.agent_processes}
            out.write_text(json.dumps(report_json(rows, args.agent, settings), indent=2) + "\n")
        except OSError as exc:
            raise UsageError(f"--out {out} could not be written ({exc.strerror or exc}); "
                             "the table above has the results") from None
        print(f"report written to {out}")
    errors = sum(r.error is not None for r in rows)
    if errors:
        print(f"t1async: {errors} of {len(rows)} tasks errored (see the error column); exit status 1", file=sys.stderr)
        return 1
    return 0


def run_images(args: argparse.Namespace) -> int:
    """``t1async images bootstrap``: build the stand-ins, print what stands in for what and which
    Debian release and Python back each. 1 when a build failed or an image named (by ``--name``
    or a task's ``FROM``) has no stand-in and is not in local storage; the others are done first."""


    engine = resolve_engine(load_config(args.config).env.container)
    names = list(args.name) or list(DEFAULT_BOOTSTRAP_TAGS)
    users: dict[str, list[str]] = {}
    if args.tasks:
        try:
            folders = task_folders(args.tasks)
        except TaskError as exc:
            raise UsageError(str(exc)) from None
        for folder in folders:
            try:
                task = load_task(folder)
            except TaskError as exc:
                print(f"  {Path(folder).name}: not a loadable task, skipped ({exc})", file=sys.stderr)
                continue
            images = from_images(task.dockerfile.read_text()) if task.dockerfile else [task.docker_image or "debian:bookworm"]
            for image in images:
                names.append(image)
                users.setdefault(image, []).append(task.name)
    names = list(dict.fromkeys(names))
    print(f"bootstrapping {len(names)} image names with {engine.name} (mmdebstrap: about a minute per Debian "
          "release; building CPython for the python 3.13 bookworm names: several minutes, once)", flush=True)
    try:
        report = bootstrap(engine, names, rebuild=args.rebuild)
    except SandboxError as exc:
        print(f"t1async: error: {exc}", file=sys.stderr)
        return 1
    for tag, seconds in report.built.items():
        print(f"  built {tag} in {seconds:.0f} s")
    for tag, backing in report.backing.items():
        print(f"  {tag}: {backing or 'could not be run to say what backs it'}")
    for name, (tag, differences) in report.tagged.items():
        print(f"  {name} <- {tag}: {differences}")
    for name in report.present:
        print(f"  {name}: already present (left alone)")
    if report.unknown:
        for name in report.unknown:
            used = users.get(name)
            print(f"t1async: error: no stand-in for {name}" + (f" (used by {', '.join(used)})" if used else "")
                  + f": `{engine.name} pull` it where a registry is reachable", file=sys.stderr)
        print(f"t1async: {len(report.unknown)} image(s) without a stand-in; the other {len(names) - len(report.unknown)} "
              "were done; exit status 1", file=sys.stderr)
        return 1
    return 0


def run_synth(args: argparse.Namespace) -> int:
    """``t1async synth``: write the tasks, validate them (oracle resolves, no-op does not)."""


    _quiet()
    _positive_int(args.jobs, "--jobs")
    try:
        paths = synthesize(args.family, args.n, args.out, seed=args.seed)
    except ValueError as exc:
        print(f"t1async: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(paths)} {args.family} tasks to {args.out}")
    if args.no_validate:
        return 0
    with tempfile.TemporaryDirectory(prefix="t1async-synth-") as tmp:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            reports = list(pool.map(lambda p: validate_task(load_task(p), Path(tmp)), paths))
    bad = [r for r in reports if not r.ok]
    for r in bad:
        why = r.error or (f"oracle {r.oracle and r.oracle.passed}/{r.oracle and r.oracle.total}, "
                          f"noop resolved={r.noop and r.noop.resolved}")
        print(f"  INVALID {r.name}: {why}")
    print(f"validated: {len(reports) - len(bad)}/{len(reports)} ok (oracle resolves, no-op does not)")
    return 1 if bad else 0


def run_decontam(args: argparse.Namespace) -> int:
    """``t1async decontam``: report (and with ``--drop`` delete) overlapping training tasks.

    Returns 1 when a training task is flagged and kept, or could not be read (not checked)."""


    _quiet()
    env = load_config(args.config).env
    source = f"env.decontam_ngram in {args.config}" if args.config else "env.decontam_ngram"
    n = args.ngram if args.ngram is not None else env.decontam_ngram
    if n < 1:
        raise UsageError(f"{'--ngram' if args.ngram is not None else source} must be >= 1, got {n}")
    threshold = args.threshold if args.threshold is not None else env.decontam_threshold
    if math.isnan(threshold) or not 0 < threshold <= 1:
        where = "--threshold" if args.threshold is not None else source.replace("ngram", "threshold")
        raise UsageError(f"{where} must be a fraction with 0 < F <= 1, got {threshold}")
    out = check_out_file(args.out) if args.out else None
    if args.drop:
        check_drop_folders(args.train, args.benchmark)
    rows = decontaminate(args.train, args.benchmark, n=n, threshold=threshold, drop=args.drop)
    print(format_report(rows, threshold, n))
    if out is not None:
        doc = {"ngram": n, "threshold": threshold, "tasks": [asdict(r) for r in rows],
               "flagged": sum(r.flagged for r in rows), "dropped": sum(r.dropped for r in rows),
               "unreadable": sum(r.error is not None for r in rows)}
        try:
            out.write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as exc:
            raise UsageError(f"--out {out} could not be written ({exc.strerror or exc}); "
                             "the report above has the results") from None
    return 1 if any((r.flagged and not r.dropped) or r.error is not None for r in rows) else 0
