"""Validate task folders (either Terminal-Bench layout): the oracle must resolve each task and a no-op agent must not.

For every task folder under ``--tasks-dir`` (default: the shipped ``t1async/envs/tasks``), runs in the
local sandbox a no-op agent (build the environment, verify) and the oracle (build, run
``solution/solve.sh``, verify), then prints one row per task::

    task              oracle  noop  ok
    count-words       3/3     1/3   yes

Exit status: 0 when every task is ok; 1 when any folder is invalid, any oracle fails, or any
no-op agent resolves its task; 2 when the sandbox cannot run here.

Usage: ``python tools/validate_tasks.py [--tasks-dir DIR] [--jobs N] [NAME ...]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loguru import logger

from t1async.envs.sandboxes.sandbox import SandboxUnavailable, check_sandbox_available
from t1async.envs.taskio.loading import load_task, task_folders
from t1async.envs.taskio.task import TaskError
from t1async.envs.terminal import TaskValidation, validate_task

DEFAULT_TASKS_DIR = Path(__file__).resolve().parents[1] / "envs" / "tasks"


def validate_folder(folder: Path, root: Path) -> TaskValidation:
    """Load and validate one task folder; an invalid folder becomes a failed row."""
    try:
        task = load_task(folder)
    except TaskError as exc:
        return TaskValidation(folder.name, error=str(exc))
    report = validate_task(task, root)
    report.name = folder.name  # rows are named by folder, as on the command line
    return report


def _score(result) -> str:
    return "-" if result is None else f"{result.passed}/{result.total}"


def format_table(rows: list[TaskValidation]) -> str:
    """Render the rows as a fixed-width table, failures followed by their reasons."""
    width = max([len("task")] + [len(r.name) for r in rows])
    lines = [f"{'task':<{width}}  oracle  noop    ok"]
    for row in rows:
        lines.append(f"{row.name:<{width}}  {_score(row.oracle):<6}  {_score(row.noop):<6}  {'yes' if row.ok else 'NO'}")
    for row in rows:
        if row.ok:
            continue
        if row.error:
            reason = row.error
        elif row.oracle is not None and not row.oracle.resolved:
            failed = [t.name for t in row.oracle.tests if not t.passed]
            reason = f"oracle did not resolve: {row.oracle.error or 'failed tests: ' + ', '.join(failed)}"
        else:
            reason = "the no-op agent resolves the task: the tests do not check the work"
        lines.append(f"  {row.name}: {reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="task folder names to validate (default: all)")
    parser.add_argument("--tasks-dir", type=Path, default=DEFAULT_TASKS_DIR, help="folder of task folders")
    parser.add_argument("--jobs", type=int, default=2, help="tasks validated in parallel")
    args = parser.parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    try:
        check_sandbox_available("local")
    except SandboxUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        folders = task_folders(args.tasks_dir)
    except TaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.names:
        missing = sorted(set(args.names) - {f.name for f in folders})
        if missing:
            print(f"error: no task folder(s) {missing} under {args.tasks_dir}", file=sys.stderr)
            return 1
        folders = [f for f in folders if f.name in set(args.names)]
    if not folders:
        print(f"error: no task folders under {args.tasks_dir}", file=sys.stderr)
        return 1
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="t1async-validate-") as tmp:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            rows = list(pool.map(lambda f: validate_folder(f, Path(tmp)), folders))
    print(format_table(rows))
    bad = sum(not r.ok for r in rows)
    print(f"{len(rows) - bad}/{len(rows)} tasks ok in {time.monotonic() - started:.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
