"""``t1async synth``: training tasks generated from parametrized families (TB2 layout).

Each family is a function ``(rng) -> TaskFiles``: it draws its parameters (file contents, names,
keywords, thresholds, instruction wording) from a seeded :class:`random.Random`, and returns the
instruction, the environment files (copied into /app by a generated Dockerfile), the pytest
verifier with several tests (dense reward) whose expected values were computed here, and an
oracle ``solve.sh``. The same ``--seed`` gives the same tasks. Every generated task is validated
like a shipped one (oracle resolves, no-op does not) unless validation is turned off.

Families (:data:`FAMILIES`): ``count-matches``, ``sum-column``, ``sort-unique``, ``rename-ext``,
``json-filter``, ``make-executable`` (one oracle command each), and the multi-step ``mkdir-write``
(make a folder, write a file in it), ``copy-count`` (make a folder, copy a log there, count its
lines), ``grep-count`` (save matching lines, count them) and ``tar-folder`` (pack a folder into a
.tar.gz, delete it). The multi-step families are sized for a tiny policy warm-started on their
oracles: every oracle command is at most 32 tokens of the shipped tokenizer and is built only
from parameters that appear literally in the instruction, and each command earns verifier tests
of its own (dense reward). :func:`oracle_commands` splits a ``solve.sh`` into the commands a
demonstration sends one per turn. These are written for t1async and are not taken from any
benchmark; run ``t1async decontam`` against a benchmark before training on them.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
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


def mkdir_write(rng: random.Random) -> TaskFiles:
    """Create a folder, then a one-line file in it (two commands)."""
    folder, stem = rng.sample(WORDS, 2)
    name, line = f"{stem}.txt", f"{rng.choice(WORDS)}-{rng.randint(10, 99)}"
    instruction = _pick(rng, "Create the folder /app/{d} and, inside it, a file named {f} whose only line is `{c}`.",
                        "Make a new directory /app/{d}. In it, write the line `{c}` to a file called {f}.",
                        "/app/{d} does not exist yet. Create it, then put a file {f} in it containing just `{c}`.").format(
                            d=folder, f=name, c=line)
    tests = f'''
        from pathlib import Path

        D = Path("/app/{folder}")

        def test_folder_exists():
            assert D.is_dir()

        def test_file_exists():
            assert (D / "{name}").is_file()

        def test_content():
            assert (D / "{name}").read_text().strip() == "{line}"

        def test_nothing_else_in_folder():
            assert sorted(p.name for p in D.iterdir()) == ["{name}"]
    '''
    solution = f"mkdir -p {folder}\necho {line} > {folder}/{name}\n"
    return TaskFiles(instruction, {"README.txt": "Work in this folder.\n"}, tests, solution)


def copy_count(rng: random.Random) -> TaskFiles:
    """Make a folder, copy a log into it, write the log's line count there (three commands)."""
    stem, folder = rng.sample(WORDS, 2)
    log, count = f"{stem}.log", rng.choice(("lines.txt", "count.txt", "total.txt"))
    text = "".join(f"{rng.choice(LEVELS)} {' '.join(rng.sample(WORDS, 3))}\n" for _ in range(rng.randint(5, 40)))
    instruction = _pick(rng, "Create the folder /app/{d}, copy /app/{l} into it (same name), then write the number of lines of {l} to /app/{d}/{c}.",
                        "Back up /app/{l}: make a directory /app/{d} and copy the log there under the same name. "
                        "Then save its line count, as a bare number, in /app/{d}/{c}.").format(d=folder, l=log, c=count)
    tests = f'''
        from pathlib import Path

        D = Path("/app/{folder}")
        TEXT = {text!r}

        def test_folder_exists():
            assert D.is_dir()

        def test_copy_exists():
            assert (D / "{log}").is_file()

        def test_copy_identical():
            assert (D / "{log}").read_text() == TEXT

        def test_original_kept():
            assert Path("/app/{log}").read_text() == TEXT

        def test_count_value():
            assert (D / "{count}").read_text().strip() == "{text.count(chr(10))}"
    '''
    solution = f"mkdir -p {folder}\ncp {log} {folder}/\nwc -l < {log} > {folder}/{count}\n"
    return TaskFiles(instruction, {log: text}, tests, solution)


def grep_count(rng: random.Random) -> TaskFiles:
    """Save the lines that contain a word, then count them (two commands)."""
    word = rng.choice(WORDS)
    source = f"{rng.choice(('notes', 'journal', 'diary', 'memo'))}.txt"
    hits = rng.choice(("hits.txt", "matches.txt", "found.txt"))
    others = [w for w in WORDS if w != word]
    lines = [" ".join(rng.sample(others, rng.randint(3, 5))) for _ in range(rng.randint(10, 40))]
    for _ in range(rng.randint(1, 6)):  # at least one match, so grep succeeds
        words = rng.sample(others, rng.randint(2, 4))
        words.insert(rng.randint(0, len(words)), word)
        lines.insert(rng.randint(0, len(lines)), " ".join(words))
    expected = [line for line in lines if word in line]
    text = "\n".join(lines) + "\n"
    instruction = _pick(rng, "Write every line of /app/{s} that contains `{w}` to /app/{h} (same order), then write how many such lines there are to /app/count.txt.",
                        "Find the lines of /app/{s} mentioning `{w}` and save them, in their original order, to /app/{h}. "
                        "Also put the number of those lines, alone, in /app/count.txt.").format(s=source, w=word, h=hits)
    tests = f'''
        from pathlib import Path

        EXPECTED = {expected!r}

        def test_hits_exist():
            assert Path("/app/{hits}").is_file()

        def test_hits_lines():
            assert Path("/app/{hits}").read_text().splitlines() == EXPECTED

        def test_count_exists():
            assert Path("/app/count.txt").is_file()

        def test_count_value():
            assert Path("/app/count.txt").read_text().strip() == str(len(EXPECTED))
    '''
    solution = f"grep {word} {source} > {hits}\nwc -l < {hits} > count.txt\n"
    return TaskFiles(instruction, {source: text}, tests, solution)


def tar_folder(rng: random.Random) -> TaskFiles:
    """Pack a folder into a .tar.gz, then delete the folder (two commands)."""
    folder, archive = rng.sample(WORDS, 2)
    files = {f"{folder}/{name}.txt": f"{name} {rng.randint(0, 999)}\n" for name in rng.sample(WORDS, rng.randint(2, 5))}
    instruction = _pick(rng, "Pack the folder /app/{d} into a gzip-compressed tar archive /app/{a}.tar.gz (member paths starting with {d}/), then delete /app/{d}.",
                        "Archive /app/{d} as /app/{a}.tar.gz (tar + gzip, paths inside beginning with {d}/) and remove the original folder afterwards.").format(
                            d=folder, a=archive)
    tests = f'''
        import tarfile
        from pathlib import Path

        A = Path("/app/{archive}.tar.gz")
        FILES = {files!r}

        def test_archive_exists():
            assert A.is_file()

        def test_archive_is_gzip_tar():
            with tarfile.open(A, "r:gz") as tar:
                assert tar.getmembers()

        def test_archive_contents():
            with tarfile.open(A, "r:gz") as tar:
                got = {{m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}}
            assert got == FILES

        def test_folder_removed():
            assert not Path("/app/{folder}").exists()
    '''
    solution = f"tar czf {archive}.tar.gz {folder}\nrm -r {folder}\n"
    return TaskFiles(instruction, files, tests, solution)


SLOW_VERIFIER_MEDIAN_S = 1.5
"""Median seconds of a ``slow-build`` verifier (its test suite's running time)."""
SLOW_VERIFIER_SIGMA = 1.3
"""Log-space standard deviation of the verifier's seconds: p99 = median x exp(2.33 sigma), about 20x the median."""
SLOW_VERIFIER_MAX_S = 45.0
"""Longest verifier draw, seconds (under the generated tasks' 60 s ``[verifier] timeout_sec``)."""
SLOW_BUILD_MEDIAN_S = 0.5
"""Median seconds of a ``slow-build`` build command."""
SLOW_BUILD_SIGMA = 1.0
"""Log-space standard deviation of the build command's seconds."""
SLOW_BUILD_MAX_S = 4.0
"""Longest build draw, seconds (under ``env.command_timeout_s`` of configs/local.yaml, 5 s)."""


def slow_seconds(rng: random.Random, median_s: float, sigma: float, max_s: float) -> float:
    """A lognormal draw (``median_s x exp(sigma x N(0, 1))``), capped at ``max_s``, rounded to 10 ms."""
    return round(min(max_s, median_s * math.exp(sigma * rng.gauss(0.0, 1.0))), 2)


def slow_build(rng: random.Random) -> TaskFiles:
    """Run a slow build script and save its output; the test suite is slow too (the long-tail family).

    Terminal-Bench episodes spend their time in commands (builds, installs, training runs) and in
    verifiers (test suites), with a heavy tail: a median of tens of seconds to minutes and a p99
    of many minutes. This family keeps the shape and divides the scale by about 30 so that a
    benchmark fits in minutes on a small machine: each instance draws, from its own seeded
    ``rng`` (so the time is a property of the task, the same at every episode), a verifier time
    lognormal with median :data:`SLOW_VERIFIER_MEDIAN_S` (1.5 s) and sigma
    :data:`SLOW_VERIFIER_SIGMA` (1.3: p90 about 8 s, p99 about 30 s, mean about 3.5 s), capped at
    :data:`SLOW_VERIFIER_MAX_S`, spent in every episode whatever the agent did; and a build time
    (median 0.5 s, sigma 1.0, capped at 4 s) spent only when the agent runs ``build.sh``. Both
    are ``sleep``s, so they cost wall time, not CPU, as waiting on a remote sandbox does.
    """
    verifier_s = slow_seconds(rng, SLOW_VERIFIER_MEDIAN_S, SLOW_VERIFIER_SIGMA, SLOW_VERIFIER_MAX_S)
    build_s = slow_seconds(rng, SLOW_BUILD_MEDIAN_S, SLOW_BUILD_SIGMA, SLOW_BUILD_MAX_S)
    build_id = f"{rng.choice(WORDS)}-{rng.randint(100, 999)}"
    out = rng.choice(("build.txt", "result.txt", "output.txt"))
    script = f"#!/bin/sh\n# a slow build: {build_s} s\nsleep {build_s}\necho {build_id}\n"
    instruction = _pick(rng, "Run /app/build.sh (a slow build) and save what it prints to /app/{o}.",
                        "/app/build.sh builds the project and prints the build id; it takes a while. Run it and write its output to /app/{o}.").format(o=out)
    tests = f'''
        import time
        from pathlib import Path

        time.sleep({verifier_s})  # this test suite's running time, drawn for this task (t1async/commands/synth.py slow_build)

        def test_output_exists():
            assert Path("/app/{out}").is_file()

        def test_output_value():
            assert Path("/app/{out}").read_text().strip() == "{build_id}"

        def test_script_untouched():
            assert Path("/app/build.sh").read_text() == {script!r}
    '''
    return TaskFiles(instruction, {"build.sh": script}, tests, f"./build.sh > {out}\n", modes={"build.sh": 0o755})


FAMILIES: dict[str, Callable[[random.Random], TaskFiles]] = {
    "count-matches": count_matches,
    "sum-column": sum_column,
    "sort-unique": sort_unique,
    "rename-ext": rename_ext,
    "json-filter": json_filter,
    "make-executable": make_executable,
    "mkdir-write": mkdir_write,
    "copy-count": copy_count,
    "grep-count": grep_count,
    "tar-folder": tar_folder,
    "slow-build": slow_build,
}
"""Task families by name (``t1async synth --family NAME``)."""

TIMING_FAMILIES = ("slow-build",)
"""Families whose running time is the point (``t1async bench async``); ``t1async bench learning``
leaves them out by default (their sleeps would only slow its fixed-minutes runs)."""


_SET_OPTIONS = re.compile(r"set(\s+(-[A-Za-z]*o\s+\w+|[-+][A-Za-z]+))+")
"""A shell-options line such as ``set -e``, ``set -euo pipefail``, ``set -o pipefail``, ``set +x``."""


def _shell_accepts(text: str) -> bool:
    """Whether ``bash -n`` parses ``text`` as complete commands (no syntax error, no heredoc left open)."""
    if re.search(r"(?<!\\)(\\\\)*\\$", text):  # ends in a line continuation: bash -n would accept it
        return False
    run = subprocess.run(["bash", "-n"], input=text + "\n", capture_output=True, text=True, timeout=10)
    return run.returncode == 0 and not run.stderr.strip()  # an open heredoc is only a warning


def oracle_commands(solution_text: str) -> list[str]:
    """Split a ``solve.sh`` body into the complete shell commands an agent would type, one per turn.

    Dropped: the shebang line, blank lines and comment-only lines between commands, shell-options
    lines (``set -e``, ``set -euo pipefail``, ...) and a ``cd /app`` before the first command (the
    episode's shell already starts in /app). Lines are accumulated until ``bash -n`` accepts the
    text, so a backslash continuation, a heredoc, an ``if``/``for``/``while`` block or a quote
    spanning lines becomes one command; its lines are kept verbatim, joined by ``\\n``.

    Args:
        solution_text: the script's text (str), e.g. ``Path("solution/solve.sh").read_text()``.

    Returns:
        The commands in script order (list of str, no trailing newline); empty for a script with
        no commands.

    Raises:
        ValueError: the script ends inside an incomplete (or invalid) command; the message quotes
            the command's text and its first line number.
    """
    commands: list[str] = []
    pending: list[str] = []
    start = 0
    for number, line in enumerate(solution_text.splitlines(), 1):
        if not pending:
            stripped = line.strip()
            if not stripped or stripped.startswith("#") or _SET_OPTIONS.fullmatch(stripped):
                continue
            if not commands and re.fullmatch(r"cd\s+/app/?", stripped):
                continue
            start = number
        pending.append(line)
        text = "\n".join(pending).rstrip()
        if _shell_accepts(text):
            commands.append(text)
            pending = []
    if pending:
        text = "\n".join(pending)
        raise ValueError(f"solve.sh line {start}: the script ends inside an incomplete or invalid shell command: "
                         f"{text[:300]!r}; close its quote, heredoc or block (or fix its syntax)")
    return commands


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
