"""Published Terminal-Bench tasks as their authors wrote them: the oracle and the no-op agent on
every task of one or more folders, with the reason of every task the oracle did not resolve.

For each folder given with ``--tasks`` (TB1 ``task.yaml`` or TB2/Harbor ``task.toml`` tasks, kept
outside this repository), runs ``t1async eval`` in-process twice, ``--agent oracle`` then
``--agent noop``, with the sandbox and network mode given, and classifies each task the oracle
did not resolve by the evidence in its row and logs (the error, ``verifier.txt``,
``commands.log``, ``build.log``):

* ``unreachable``: the task needs what this machine cannot give: a host other than the package
  registries (name resolution fails, a clone from GitHub, a model hub), a base image with no
  offline stand-in, a file its public copy lacks (a ``COPY`` source missing);
* ``task``: the task's own oracle is not a solution (TB1's ``no-verified-solution`` tag, or a
  solution script with no command in it), so no harness can resolve it by its oracle;
* ``setup``: this machine was not prepared for the task: a base image that has an offline
  stand-in was not bootstrapped ("not in local storage: run `t1async images bootstrap`"): run
  ``t1async images bootstrap --tasks DIR`` once and run the bench again;
* ``t1async``: anything else, until a reason is given. ``--reasons FILE`` (YAML: ``task: [class,
  reason]``) records a reason found by reading the logs, and overrides the automatic class;
  a task listed there that resolves is reported as such (the annotation is then stale).

Prints one JSON object (the summary and every row) and, with ``--report FILE``, writes a
Markdown table: task, layout, oracle and noop passed/total, seconds, class, reason.

Usage: ``t1async bench tb-corpus --tasks DIR [--tasks DIR ...] [--sandbox container]
[--network harness] [--concurrency 1] [--reasons FILE] [--report FILE] [--logs DIR]``
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import yaml

from t1async.commands.evaluate import evaluate
from t1async.envs.taskio.loading import load_task, task_folders

UNREACHABLE = (
    (re.compile(r"Temporary failure resolving|Could not resolve host|Name or service not known|"
                r"Network is unreachable|getaddrinfo failed|Failed to establish a new connection|"
                r"nodename nor servname"), "a host other than the package registries"),
    (re.compile(r"no stand-in for it|has no stand-in"), "a base image with no offline stand-in"),
    (re.compile(r"COPY source '[^']+' not found"), "a file its public copy lacks"),
    (re.compile(r"huggingface\.co|hf\.co/"), "a model hub"),
    (re.compile(r"github\.com/[^\s]+ .*(?:fatal|Could not)|git clone https?://github"), "a clone from GitHub"),
)
"""Evidence that a task needs what this machine cannot reach, and how to say so."""


NOT_BOOTSTRAPPED = re.compile(r"base image '([^']+)' is not in local storage: run `t1async images bootstrap`")
"""The error of a ``FROM`` image that has a stand-in which was not built (class ``setup``)."""


def _evidence(logs: Path, row: dict) -> str:
    texts = [row.get("error") or ""]
    for name in ("error.txt", "verifier.txt", "commands.log", "build.log"):
        path = logs / row["task"] / name
        if path.is_file():
            texts.append(path.read_text(errors="replace")[-200_000:])
    return "\n".join(texts)


def unsolved_oracle(folder: Path) -> str | None:
    """Why the task at ``folder`` has no real oracle (see ``task`` in the module docstring), or None."""
    try:
        task = load_task(folder)
    except Exception:  # noqa: BLE001  (an invalid task is classified by its eval row)
        return None
    tags = task.metadata.get("tags") or []
    if isinstance(tags, list) and "no-verified-solution" in tags:
        return "its oracle is unverified (tag no-verified-solution)"
    script = task.solution_path
    if script is not None and script.is_file() and not task.solution_commands:
        lines = [ln.strip() for ln in script.read_text(errors="replace").splitlines()]
        if not any(ln and not ln.startswith("#") for ln in lines):
            return f"its oracle {script.name} holds no command"
    return None


def classify(row: dict, logs: Path, reasons: dict) -> tuple[str, str]:
    """``(class, reason)`` for one oracle row: ``("resolved", "")``, a ``--reasons`` entry, or the
    automatic class (see the module docstring)."""
    if row["resolved"]:
        return ("resolved", "") if row["task"] not in reasons else ("resolved", "stale annotation: " + reasons[row["task"]][1])
    if row["task"] in reasons:
        kind, why = reasons[row["task"]]
        return kind, why
    unsolved = unsolved_oracle(Path(row["folder"]) / row["task"]) if row.get("folder") else None
    if unsolved:
        return "task", unsolved
    evidence = _evidence(logs, row)
    missing = NOT_BOOTSTRAPPED.search(evidence)
    if missing:
        return "setup", (f"base image {missing.group(1)} not bootstrapped on this machine: run `t1async images "
                         f"bootstrap --tasks {row.get('folder') or 'DIR'}`")
    for pattern, what in UNREACHABLE:
        match = pattern.search(evidence)
        if match:
            return "unreachable", f"needs {what} (`{match.group(0)[:80]}`)"
    first = (row.get("error") or "").splitlines()[0][:160] if row.get("error") else f"{row['passed']}/{row['total']} tests"
    return "t1async", first


def main(argv: list[str] | None = None) -> int:
    """Run the corpus (see the module docstring); 0 when it ran, 2 for bad input."""
    parser = argparse.ArgumentParser(prog="t1async bench tb-corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", action="append", required=True, help="folder of task folders (repeatable)")
    parser.add_argument("--sandbox", default="container")
    parser.add_argument("--network", default="harness", help="as `t1async eval --network`")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--reasons", help="YAML file: task: [class, reason]")
    parser.add_argument("--report", help="write the Markdown table here")
    parser.add_argument("--logs", help="per-task logs (default: a temporary folder)")
    args = parser.parse_args(argv)
    folders = [Path(p) for p in args.tasks]
    for folder in folders:
        if not folder.is_dir():
            print(f"tb-corpus: error: --tasks {folder}: not a folder", file=sys.stderr)
            return 2
    reasons = {}
    if args.reasons:
        reasons = {str(k): tuple(v) for k, v in (yaml.safe_load(Path(args.reasons).read_text()) or {}).items()}
    logs_root = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="t1async-tb-corpus-"))
    rows = []
    for folder in folders:
        layouts = {}
        for path in task_folders(folder):
            try:
                layouts[path.name] = load_task(path).layout
            except Exception:  # noqa: BLE001  (an invalid task is reported by its eval row)
                layouts[path.name] = "tb2" if (path / "task.toml").is_file() else "tb1"
        results = {}
        for agent in ("oracle", "noop"):
            logs = logs_root / folder.name / agent
            started = time.monotonic()
            results[agent] = {r.task: r for r in evaluate(folder, agent, concurrency=args.concurrency,
                                                          sandbox=args.sandbox, logs=logs, network=args.network)}
            print(f"tb-corpus: {folder}: {agent} done in {time.monotonic() - started:.0f} s", file=sys.stderr)
        for name, oracle in sorted(results["oracle"].items()):
            noop = results["noop"].get(name)
            row = {"task": name, "folder": str(folder), "layout": layouts.get(name, ""),
                   "oracle": f"{oracle.passed}/{oracle.total}", "resolved": oracle.resolved,
                   "passed": oracle.passed, "total": oracle.total, "error": oracle.error,
                   "oracle_s": round(oracle.seconds, 1), "network": oracle.network or None,
                   "agent_processes": oracle.agent_processes,
                   "noop": f"{noop.passed}/{noop.total}" if noop else "", "noop_resolved": bool(noop and noop.resolved),
                   "noop_s": round(noop.seconds, 1) if noop else None}
            row["class"], row["reason"] = classify(row, logs_root / folder.name / "oracle", reasons)
            rows.append(row)
    reachable = [r for r in rows if r["class"] not in ("unreachable", "task", "setup")]
    summary = {"tasks": len(rows), "tb1": sum(r["layout"] == "tb1" for r in rows),
               "tb2": sum(r["layout"] == "tb2" for r in rows), "oracle_resolved": sum(r["resolved"] for r in rows),
               "reachable": len(reachable), "reachable_resolved": sum(r["resolved"] for r in reachable),
               "unreachable": sum(r["class"] == "unreachable" for r in rows),
               "no_oracle": sum(r["class"] == "task" for r in rows), "setup": sum(r["class"] == "setup" for r in rows),
               "t1async": sum(r["class"] == "t1async" for r in rows),
               "noop_resolved": sum(r["noop_resolved"] for r in rows), "logs": str(logs_root)}
    if args.report:
        lines = ["| task | layout | oracle | noop | oracle s | noop s | class | reason |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['task']} | {r['layout']} | {r['oracle']}{' resolved' if r['resolved'] else ''} | {r['noop']} | "
                  f"{r['oracle_s']} | {r['noop_s']} | {r['class']} | {r['reason'].replace('|', '/')} |" for r in rows]
        Path(args.report).write_text("\n".join(lines) + "\n")
    print(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
