"""``t1async decontam``: flag (and optionally drop) training tasks that overlap a benchmark.

Training tasks must stay disjoint from the benchmark results are reported on. For every
training task, its instruction and its oracle solution are each compared with every benchmark
task's instruction and solution by word n-gram overlap:

    overlap(train_text, bench) = |ngrams(train_text) & ngrams(bench)| / |ngrams(train_text)|

with ``ngrams`` the set of n consecutive lower-cased word tokens (``[a-z0-9_]+``; n =
``env.decontam_ngram``). A text shorter than n words is compared as one n-gram of all its words.
A training task is flagged when its instruction's or its solution's overlap with any single
benchmark task reaches ``env.decontam_threshold``; the report names the closest benchmark task.
With ``drop``, flagged task folders are deleted from the training folder (refused when the
training and benchmark folders are the same or one contains the other: every task would match
itself). A training folder that is not a valid task is reported with ``error`` set (it was not
checked, and is never dropped); an invalid benchmark folder is logged as a warning.

Source of the method: n-gram overlap decontamination as used for LLM benchmarks (GPT-3's 13-gram
filter, Brown et al. 2020); n and the threshold are configurable because short shell tasks share
few long n-grams.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from t1async.envs.taskio.loading import load_task, task_folders
from t1async.envs.taskio.task import Task, TaskError

_TOKEN = re.compile(r"[a-z0-9_]+")


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """The set of word n-grams of ``text`` (lower-cased ``[a-z0-9_]+`` tokens)."""
    words = _TOKEN.findall(text.lower())
    if not words:
        return set()
    if len(words) < n:
        return {tuple(words)}
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def task_texts(task: Task) -> dict[str, str]:
    """``{"instruction": ..., "solution": ...}`` of a task (solution empty when it has none)."""
    solution = task.solution_path.read_text(errors="replace") if task.solution_path else ""
    return {"instruction": task.instruction, "solution": solution}


@dataclass
class Overlap:
    """One training task's worst overlap with the benchmark.

    Attributes:
        task: the training task's folder name.
        overlap: the highest overlap fraction found (instruction or solution), 0..1.
        field: ``instruction`` or ``solution`` (which text of the training task).
        benchmark_task: the benchmark task it overlaps most.
        flagged: ``overlap >= threshold``.
        dropped: the folder was deleted.
        error: why the folder could not be read as a task (then it was not checked), else None.
    """

    task: str
    overlap: float
    field: str
    benchmark_task: str
    flagged: bool
    dropped: bool = False
    error: str | None = None


def _load_all(root: Path) -> tuple[list[tuple[Path, Task]], list[tuple[Path, str]]]:
    """``(loaded, unreadable)``: the valid task folders under ``root`` and ``(folder, why)`` for the rest."""
    loaded, unreadable = [], []
    for folder in task_folders(root):
        try:
            loaded.append((folder, load_task(folder)))
        except TaskError as exc:
            unreadable.append((folder, (str(exc).splitlines() or [type(exc).__name__])[0][:500]))
    return loaded, unreadable


def check_drop_folders(train_dir: str | Path, benchmark_dir: str | Path) -> None:
    """Refuse ``drop`` when the training and benchmark folders are the same or nested.

    Raises:
        TaskError: they resolve to the same folder, or one contains the other.
    """
    train, bench = Path(train_dir).resolve(), Path(benchmark_dir).resolve()
    if train == bench or train in bench.parents or bench in train.parents:
        raise TaskError(f"--drop refused: the training folder {train} and the benchmark folder {bench} "
                        f"{'are the same' if train == bench else 'are nested (one contains the other)'}, so every task would "
                        "match itself and be deleted; pass separate folders")


def decontaminate(train_dir: str | Path, benchmark_dir: str | Path, *, n: int = 8, threshold: float = 0.2,
                  drop: bool = False) -> list[Overlap]:
    """Compare every training task with every benchmark task (see the module docstring).

    Raises:
        TaskError: a folder is missing or holds no task, or ``drop`` with nested folders (see
            :func:`check_drop_folders`); ValueError: bad ``n``/``threshold``.
    """
    if n < 1 or math.isnan(threshold) or not 0 < threshold <= 1:
        raise ValueError(f"need n >= 1 and 0 < threshold <= 1, got n={n}, threshold={threshold}")
    if drop:
        check_drop_folders(train_dir, benchmark_dir)
    bench_loaded, bench_bad = _load_all(Path(benchmark_dir))
    for folder, why in bench_bad:
        logger.warning("benchmark folder {} is not a readable task and was not compared: {}", folder.name, why)
    bench = [(t.path.name, {k: ngrams(v, n) for k, v in task_texts(t).items()}) for _, t in bench_loaded]
    if not bench:
        raise TaskError(f"no benchmark task under {benchmark_dir}")
    bench_all = [(name, grams["instruction"] | grams["solution"]) for name, grams in bench]
    train_loaded, train_bad = _load_all(Path(train_dir))
    results = [Overlap(folder.name, 0.0, "", "", False, error=why) for folder, why in train_bad]
    for folder, task in train_loaded:
        best = Overlap(folder.name, 0.0, "instruction", "", False)
        for field_name, text in task_texts(task).items():
            grams = ngrams(text, n)
            if not grams:
                continue
            for name, other in bench_all:
                frac = len(grams & other) / len(grams)
                if frac > best.overlap:
                    best = Overlap(folder.name, round(frac, 4), field_name, name, False)
        best.flagged = best.overlap >= threshold
        if best.flagged and drop:
            shutil.rmtree(folder)
            best.dropped = True
        results.append(best)
    return sorted(results, key=lambda r: r.task)


def format_report(rows: list[Overlap], threshold: float, n: int) -> str:
    """Fixed-width report of the flagged and the unreadable tasks (and a count of the clean ones)."""
    flagged = [r for r in rows if r.flagged]
    checked = [r for r in rows if r.error is None]
    lines = [f"{len(flagged)}/{len(checked)} training tasks overlap the benchmark ({n}-grams, threshold {threshold:g})"]
    for r in sorted(flagged, key=lambda r: -r.overlap):
        lines.append(f"  {r.task}: {r.overlap:.0%} of its {r.field} n-grams in {r.benchmark_task}"
                     f"{' (dropped)' if r.dropped else ''}")
    unreadable = [r for r in rows if r.error is not None]
    if unreadable:
        lines.append(f"{len(unreadable)} training folder(s) could not be read as tasks (not checked, not dropped):")
        lines += [f"  {r.task}: {r.error}" for r in unreadable]
    return "\n".join(lines)
