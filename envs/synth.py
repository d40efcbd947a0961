"""``t1async synth``: training tasks generated from parametrized families (TB2 layout).

Each family is a function ``(rng) -> TaskFiles``: it draws its parameters (file contents, names,
keywords, thresholds, instruction wording) from a seeded :class:`random.Random`, and returns the
instruction, the environment files (copied into /app by a generated Dockerfile), the pytest
verifier with several tests (dense reward) whose expected values were computed here, and an
oracle ``solve.sh``. The same ``--seed`` gives the same tasks. Every generated task is validated
like a shipped one (oracle resolves, no-op does not) unless validation is turned off.

Families (:data:`FAMILIES`): ``count-matches``, ``sum-column``, ``sort-unique``, ``rename-ext``,
``json-filter``, ``make-executable``. These are written for t1async and are not taken from any
benchmark; run ``t1async decontam`` against a benchmark before training on them.
"""

from __future__ import annotations

import json
import os
import random
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris", "juniper", "kelp",
         "lumen", "maple", "nectar", "onyx", "pebble", "quartz", "raven", "sierra", "tundra", "umber", "velvet",
         "willow", "xenon", "yarrow", "zephyr")
LEVELS = ("INFO", "WARN", "ERROR", "DEBUG")
CITIES = ("Lisbon", "Oslo", "Quito", "Hanoi", "Perth", "Accra", "Lima", "Riga")
TEST_SH = "#!/bin/bash\ncd /app\npython3 -m pytest -rA -q -p no:cacheprovider /tests/test_outputs.py\n"


@dataclass
class TaskFiles:
    """One generated task before it is written.

    Attributes:
        instruction: instruction.md text.
        files: environment files (path relative to /app -> content).
        tests: test_outputs.py source.
        solution: solve.sh body (runs from /app).
        modes: extra file modes applied after COPY (path relative to /app -> octal mode).
    """

    instruction: str
    files: dict[str, str]
    tests: str
    solution: str
    modes: dict[str, int] = field(default_factory=dict)


def _pick(rng: random.Random, *options: str) -> str:
    return rng.choice(options)


def count_matches(rng: random.Random) -> TaskFiles:
    """Count log lines of one severity that mention a word."""
    level, word = rng.choice(LEVELS), rng.choice(WORDS)
    lines = [f"2025-0{rng.randint(1, 9)}-{rng.randint(10, 28)} {rng.choice(LEVELS)} "
             f"{' '.join(rng.sample(WORDS, 4))}" for _ in range(rng.randint(30, 80))]
    expected = sum(1 for line in lines if line.split()[1] == level and word in line.split()[2:])
    text = "\n".join(lines) + "\n"
    instruction = _pick(rng, "Count the lines of /app/events.log whose severity (second field) is {l} and that mention the word `{w}`. Write the number alone to /app/count.txt.",
                        "In /app/events.log, how many {l} entries contain the word `{w}`? Put just that number in /app/count.txt.").format(l=level, w=word)
    tests = f'''
        from pathlib import Path

        def test_count_file_exists():
            assert Path("/app/count.txt").is_file()

        def test_count_is_a_number():
            assert Path("/app/count.txt").read_text().strip().isdigit()

        def test_count_value():
            assert int(Path("/app/count.txt").read_text().strip()) == {expected}

        def test_log_untouched():
            assert Path("/app/events.log").read_text() == {text!r}
    '''
    solution = f"awk '$2 == \"{level}\" {{ for (i = 3; i <= NF; i++) if ($i == \"{word}\") {{ n++; break }} }} END {{ print n + 0 }}' events.log > count.txt\n"
    return TaskFiles(instruction, {"events.log": text}, tests, solution)


def sum_column(rng: random.Random) -> TaskFiles:
    """Sum one CSV column over the rows of one region."""
    region = rng.choice(CITIES)
    rows = [(i, rng.choice(CITIES), rng.randint(1, 500)) for i in range(1, rng.randint(20, 60))]
    if not any(r[1] == region for r in rows):
        rows.append((len(rows) + 1, region, rng.randint(1, 500)))
    expected = sum(r[2] for r in rows if r[1] == region)
    text = "id,city,amount\n" + "".join(f"{i},{c},{a}\n" for i, c, a in rows)
    instruction = _pick(rng, "/app/sales.csv has columns id,city,amount. Write the total amount of the rows for {c} to /app/total.txt (just the integer).",
                        "Add up the `amount` column of /app/sales.csv for city {c} and save the sum, as a bare integer, in /app/total.txt.").format(c=region)
    tests = f'''
        from pathlib import Path

        def test_total_exists():
            assert Path("/app/total.txt").is_file()

        def test_total_is_integer():
            assert Path("/app/total.txt").read_text().strip().lstrip("-").isdigit()

        def test_total_value():
            assert int(Path("/app/total.txt").read_text().strip()) == {expected}
    '''
    solution = f"awk -F, 'NR > 1 && $2 == \"{region}\" {{ s += $3 }} END {{ print s + 0 }}' sales.csv > total.txt\n"
    return TaskFiles(instruction, {"sales.csv": text}, tests, solution)


def sort_unique(rng: random.Random) -> TaskFiles:
    """Deduplicate and sort a word list."""
    words = [rng.choice(WORDS) + (str(rng.randint(0, 3)) if rng.random() < 0.3 else "") for _ in range(rng.randint(25, 70))]
    expected = sorted(set(words))
    reverse = rng.random() < 0.4
    if reverse:
        expected = expected[::-1]
    order = "reverse alphabetical" if reverse else "alphabetical"
    instruction = (f"/app/words.txt holds one word per line, with repeats. Write every distinct word once, in {order} "
                   "order (byte order), one per line, to /app/unique.txt.")
    tests = f'''
        from pathlib import Path

        EXPECTED = {expected!r}

        def test_output_exists():
            assert Path("/app/unique.txt").is_file()

        def test_no_duplicates():
            lines = Path("/app/unique.txt").read_text().split()
            assert len(lines) == len(set(lines)) and lines

        def test_same_words():
            assert set(Path("/app/unique.txt").read_text().split()) == set(EXPECTED)

        def test_order():
            assert Path("/app/unique.txt").read_text().split() == EXPECTED
    '''
    solution = f"LC_ALL=C sort -u {'-r ' if reverse else ''}words.txt > unique.txt\n"
    return TaskFiles(instruction, {"words.txt": "\n".join(words) + "\n"}, tests, solution)


def rename_ext(rng: random.Random) -> TaskFiles:
    """Rename every file with one extension to another, leaving the rest alone."""
    old, new = rng.sample(("txt", "log", "dat", "md", "csv", "bak"), 2)
    names = rng.sample(WORDS, rng.randint(6, 12))
    files, renamed, kept = {}, [], []
    for i, name in enumerate(names):
        ext = old if i % 2 == 0 else rng.choice(("cfg", "json", "ini"))
        files[f"docs/{name}.{ext}"] = f"{name} {i}\n"
        (renamed if ext == old else kept).append((name, ext, i))
    instruction = (f"In /app/docs, rename every file ending in .{old} so that it ends in .{new} instead (same base name, "
                   "same content). Leave all other files as they are.")
    tests = f'''
        from pathlib import Path

        DOCS = Path("/app/docs")
        RENAMED = {renamed!r}
        KEPT = {kept!r}

        def test_no_old_extension_left():
            assert not list(DOCS.glob("*.{old}"))

        def test_renamed_files_exist():
            assert all((DOCS / f"{{n}}.{new}").is_file() for n, _, _ in RENAMED)

        def test_contents_preserved():
            assert all((DOCS / f"{{n}}.{new}").read_text() == f"{{n}} {{i}}\\n" for n, _, i in RENAMED)

        def test_other_files_untouched():
            assert all((DOCS / f"{{n}}.{{e}}").read_text() == f"{{n}} {{i}}\\n" for n, e, i in KEPT)
    '''
    solution = f"cd docs && for f in *.{old}; do mv -- \"$f\" \"${{f%.{old}}}.{new}\"; done\n"
    return TaskFiles(instruction, files, tests, solution)


def json_filter(rng: random.Random) -> TaskFiles:
    """Select records from a JSON list by two conditions."""
    city, age = rng.choice(CITIES), rng.randint(25, 55)
    people = [{"name": f"{rng.choice(WORDS).title()}{i}", "age": rng.randint(18, 80), "city": rng.choice(CITIES)}
              for i in range(rng.randint(15, 40))]
    people.append({"name": f"Anchor{rng.randint(100, 999)}", "age": age + 1, "city": city})
    expected = sorted(p["name"] for p in people if p["city"] == city and p["age"] >= age)
    instruction = (f"/app/people.json is a list of objects with name, age and city. Write the names of the people who live "
                   f"in {city} and are at least {age} years old to /app/names.txt, one per line, sorted.")
    tests = f'''
        from pathlib import Path

        EXPECTED = {expected!r}

        def test_names_file_exists():
            assert Path("/app/names.txt").is_file()

        def test_names_are_right():
            assert set(Path("/app/names.txt").read_text().split()) == set(EXPECTED)

        def test_names_sorted():
            assert Path("/app/names.txt").read_text().split() == EXPECTED
    '''
    solution = (f"python3 -c \"import json; p = json.load(open('people.json')); "
                f"print('\\\\n'.join(sorted(x['name'] for x in p if x['city'] == '{city}' and x['age'] >= {age})))\" > names.txt\n")
    return TaskFiles(instruction, {"people.json": json.dumps(people, indent=1) + "\n"}, tests, solution)


def make_executable(rng: random.Random) -> TaskFiles:
    """Make exactly the scripts with a prefix executable."""
    prefix = rng.choice(("run_", "task_", "job_"))
    names = rng.sample(WORDS, rng.randint(5, 9))
    files, targets, others = {}, [], []
    for i, name in enumerate(names):
        fname = (prefix if i % 2 == 0 else "lib_") + name + ".sh"
        files[f"scripts/{fname}"] = f"#!/bin/sh\necho {name}\n"
        (targets if i % 2 == 0 else others).append(fname)
    instruction = (f"Make every script in /app/scripts whose name starts with `{prefix}` executable (by its owner at least). "
                   "The other scripts must stay non-executable.")
    tests = f'''
        import os
        from pathlib import Path

        S = Path("/app/scripts")

        def test_targets_executable():
            assert all(os.access(S / n, os.X_OK) for n in {targets!r})

        def test_others_not_executable():
            assert not any(os.access(S / n, os.X_OK) for n in {others!r})

        def test_scripts_run():
            import subprocess
            assert all(subprocess.run([str(S / n)], capture_output=True).returncode == 0 for n in {targets!r})
    '''
    solution = f"chmod u+x scripts/{prefix}*.sh\n"
    return TaskFiles(instruction, files, tests, solution, modes={rel: 0o644 for rel in files})


FAMILIES: dict[str, Callable[[random.Random], TaskFiles]] = {
    "count-matches": count_matches,
    "sum-column": sum_column,
    "sort-unique": sort_unique,
    "rename-ext": rename_ext,
    "json-filter": json_filter,
    "make-executable": make_executable,
}
"""Task families by name (``t1async synth --family NAME``)."""


def write_task(folder: Path, name: str, family: str, spec: TaskFiles) -> Path:
    """Write ``spec`` as a TB2 task folder ``folder/name`` and return it."""
    task = folder / name
    (task / "environment" / "files").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "task.toml").write_text(
        f'[task]\nname = "{name}"\n\n[metadata]\ndifficulty = "easy"\ncategory = "synthetic"\n'
        f'tags = ["synth", "{family}"]\n\n[verifier]\ntimeout_sec = 60\n\n[agent]\ntimeout_sec = 120\n\n'
        "[environment]\ncpus = 1\nmemory_mb = 1024\nstorage_mb = 256\nallow_internet = false\n")
    (task / "instruction.md").write_text(spec.instruction.strip() + "\n")
    for rel, content in spec.files.items():
        path = task / "environment" / "files" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    dockerfile = "FROM ubuntu:24.04\nWORKDIR /app\nCOPY files/ /app/\n"
    if spec.modes:
        dockerfile += "RUN " + " && ".join(f"chmod {mode:o} {rel}" for rel, mode in sorted(spec.modes.items())) + "\n"
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "tests" / "test.sh").write_text(TEST_SH)
    (task / "tests" / "test_outputs.py").write_text(textwrap.dedent(spec.tests).lstrip())
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\nset -e\ncd /app\n" + spec.solution)
    return task


def synthesize(family: str, n: int, out: str | Path, *, seed: int = 0) -> list[Path]:
    """Write ``n`` tasks of ``family`` under ``out`` (named ``<family>-<seed>-<i>``).

    Raises:
        ValueError: unknown family, n < 1, ``out`` is a file or cannot be created, or a task
            folder that already exists.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}: choose one of {sorted(FAMILIES)}")
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder; pass a folder path (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create the folder ({exc.strerror or exc}); pass a writable folder path") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out} is not writable; pass a writable folder path")
    names = [f"{family}-{seed}-{i:04d}" for i in range(n)]
    taken = [name for name in names if (out / name).exists()]
    if taken:  # checked before writing any, so nothing is half written
        raise ValueError(f"{out / taken[0]} already exists; use another --out or --seed")
    paths = []
    for i, name in enumerate(names):
        rng = random.Random(f"{family}/{seed}/{i}")
        paths.append(write_task(out, name, family, FAMILIES[family](rng)))
    return paths
