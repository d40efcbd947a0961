"""The ``t1async`` command line.

    t1async launch CONFIG [key=value ...]   run the asynchronous RL service (see t1async.service.launch)
    t1async status|stop|scale RUN_DIR ...   control it while it runs (see t1async.service.control)
    t1async plot RUN_DIR                    a PNG of its metrics (see t1async.commands.plot)

Each subcommand is registered by a ``register(subparsers)`` function listed in
:data:`SUBCOMMANDS` (``"module:function"`` and the command names it adds); ``register`` adds its
parser and sets ``func`` (``args -> exit status``). Only the module of the command given is
imported (every one for ``t1async --help`` or an unknown command), so ``status``, ``stop`` and
``scale`` import neither torch nor Ray, nor yaml, omegaconf, the config or the environments
(``status --json`` and ``stop`` not even rich or loguru): a few tenths of a second on an idle
machine, where importing torch alone takes 10-40 s on a busy node
(tests/unit/service/test_cli_light.py, ``t1async bench cli-light``).

Bad input (a missing config file, an unknown key, an invalid task folder, a missing sandbox tool)
prints one line ``t1async: error: ...`` and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import runpy
import sys
from pathlib import Path
from typing import Any, Callable

SUBCOMMANDS = [
    ("t1async.cli:register_launch", ("launch",)),
    ("t1async.service.control:register", ("status", "stop", "scale")),
    ("t1async.commands.plot:register", ("plot",)),
    ("t1async.commands.soak:register", ("soak",)),
    ("t1async.cli:register_bench", ("bench",)),
    ("t1async.cli:register_mismatch", ("mismatch",)),
    ("t1async.transport.keys:register_keys", ("keys",)),
    ("t1async.cli:register_sft", ("sft",)),
    ("t1async.commands.model:register", ("model",)),  # model init, model check
    ("t1async.commands.plan:register", ("plan",)),  # plan: memory per GPU of a learner layout
    ("t1async.commands.env_cli:register", ("eval", "images", "synth", "decontam")),
]
"""``("module:register_function", command names it adds)``: the module is imported only when one of
its commands is run (or for ``--help``)."""


def register_launch(sub: argparse._SubParsersAction) -> None:
    """``t1async launch CONFIG [key=value ...]``."""
    p = sub.add_parser("launch", help="run the asynchronous RL loop")
    p.add_argument("config", help="YAML config, e.g. configs/local.yaml")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. learner.max_steps=4")
    p.set_defaults(func=run_launch)


def run_launch(args: argparse.Namespace) -> int:
    """Run ``launch``; 0 when every learner step ran or ``t1async stop`` stopped it, 130 after a
    signal (Ctrl-C, SIGTERM, SIGHUP), 1 if the learner stopped early (starved) or died for good, or
    its final checkpoint did not fit (one line says so)."""
    from t1async.service.control import final_checkpoint_error  # (yaml: the control module defers it too)
    from t1async.service.launch import launch  # (torch, ray: deferred until the command is known good)

    summary = launch(args.config, args.overrides)
    if summary.get("error"):
        print(f"t1async: error: {summary['error']}", file=sys.stderr)
        return 1
    unsaved = final_checkpoint_error(summary)  # (a full disk: the console and the exit status say so)
    if unsaved:
        print(f"t1async: error: {summary.get('ended', 'ended')}, but {unsaved}", file=sys.stderr)
    if summary.get("ended") == "signal":
        return 130
    if unsaved:
        return 1
    if summary.get("ended") == "stopped":
        return 0
    if not summary["max_steps"] or summary.get("steps", 0) < summary["max_steps"]:
        print(f"t1async: error: the learner stopped after {summary.get('steps', 0)} of "
              f"{summary['max_steps'] or 'unlimited'} steps; see {summary['run_dir']}/logs/learner.log", file=sys.stderr)
        return 1
    return 0


def register_mismatch(sub: argparse._SubParsersAction) -> None:
    """``t1async mismatch CONFIG [key=value ...]`` (t1async/commands/mismatch.py, imported when run)."""
    p = sub.add_parser("mismatch", help="measure the training-vs-inference mismatch (TITO x routing replay); "
                                        "prints one JSON object")
    p.add_argument("config", help="YAML config, e.g. configs/mismatch.yaml")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. mismatch.episodes=4 sampler.dtype=float32")
    p.set_defaults(func=run_mismatch)


def run_mismatch(args: argparse.Namespace) -> int:
    """Run :func:`t1async.commands.mismatch.measure` on the config; prints its JSON."""
    from t1async.config import load_config  # (yaml, omegaconf: deferred, status and stop stay light)

    cfg = load_config(args.config, args.overrides)
    from t1async.commands.mismatch import measure  # (torch: imported once the config is known good)

    print(json.dumps(measure(cfg)))
    return 0


def register_sft(sub: argparse._SubParsersAction) -> None:
    """``t1async sft --tasks DIR --out CKPT_DIR [--config YAML] [--heldout DIR] [key=value ...]``
    (t1async/commands/sft.py, imported when run)."""
    p = sub.add_parser("sft", help="supervised warm start on the tasks' oracle solutions; writes a checkpoint")
    p.add_argument("--tasks", required=True,
                   help="folder of training task folders (their oracle solutions are the demonstrations)")
    p.add_argument("--out", required=True, help="checkpoint folder to write (config.json + model.safetensors)")
    p.add_argument("--config", default=None, help="YAML config (model, env, generation and sft sections are used)")
    p.add_argument("--heldout", default=None, help="evaluate the checkpoint on this folder of tasks at the end")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. sft.steps=200")
    p.set_defaults(func=run_sft)


def run_sft(args: argparse.Namespace) -> int:
    """Check the folders, run :func:`t1async.commands.sft.run_sft`; prints its JSON.

    Raises:
        TaskError: ``--tasks`` or ``--heldout`` is not a folder, ``--out`` is a file, or the
            demonstrations cannot be built (its ValueError).
    """
    from t1async.config import load_config  # (yaml, omegaconf: deferred, status and stop stay light)
    from t1async.envs.taskio.task import TaskError  # (yaml: the task loader's, deferred with it)

    cfg = load_config(args.config, args.overrides)
    if not Path(args.tasks).is_dir():
        raise TaskError(f"--tasks {args.tasks} is not a folder; pass a folder of task folders (t1async synth --out ...)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise TaskError(f"--out {out} exists and is not a folder; pass a folder path for the checkpoint")
    if args.heldout is not None and not Path(args.heldout).is_dir():
        raise TaskError(f"--heldout {args.heldout} is not a folder; pass a folder of task folders")
    from t1async.commands import sft  # (torch: imported once the input is known good)

    try:
        result = sft.run_sft(cfg, args.tasks, out, heldout=args.heldout)
    except ValueError as e:
        raise TaskError(str(e)) from None
    print(json.dumps(result))
    return 0


def register_bench(sub: argparse._SubParsersAction) -> None:
    """``t1async bench NAME [ARGS ...]``: run ``tools/bench_NAME.py`` of a source checkout."""
    p = sub.add_parser("bench", help="run a benchmark from tools/ (tools/bench_NAME.py); prints one JSON object")
    p.add_argument("name", help="benchmark name, e.g. transport or sandbox")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace, tools: Path | None = None) -> int:
    """Run ``tools/bench_NAME.py`` as ``__main__`` with ``args``; its exit status is returned.

    As the interpreter does for a script: ``sys.exit("message")`` prints the message on stderr and gives
    status 1, ``sys.exit(N)`` gives N. ``tools``: the folder of the benchmarks (default: the source
    checkout's tools/).
    """
    tools = tools or Path(__file__).resolve().parents[1] / "tools"
    script = tools / f"bench_{args.name.replace('-', '_')}.py"  # long-horizon -> bench_long_horizon.py
    if not script.is_file():
        known = (sorted(p.stem.removeprefix("bench_").replace("_", "-") for p in tools.glob("bench_*.py"))
                 if tools.is_dir() else [])
        print(f"t1async: error: no benchmark {args.name!r} (tools/bench_{args.name.replace('-', '_')}.py); known: {known}. "
              "Benchmarks run from a source checkout (pip install -e .)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0


class OneLineErrors(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one line ``t1async: error: ...`` with exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        where = self.prog.removeprefix("t1async").strip()
        self.exit(2, f"t1async: error: {where + ': ' if where else ''}{message} (see {self.prog} --help)\n")


def _bounded(cast: Callable[[str], Any], ok: Callable[[Any], bool], what: str, doc: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``cast(value)``, refused with "must be WHAT" unless ``ok`` of it."""

    def parse(value: str):
        try:
            x = cast(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}") from None
        if not ok(x):
            raise argparse.ArgumentTypeError(f"must be {what}, got {x}")
        return x

    parse.__doc__, parse.__name__ = doc, f"{getattr(cast, '__name__', 'value')} ({what})"
    return parse


at_least_one = _bounded(int, lambda n: n >= 1, "an integer >= 1",
                        "argparse ``type``: an integer >= 1 (counts of rounds, commands, workers).")
at_least_zero = _bounded(int, lambda n: n >= 0, "an integer >= 0",
                         "argparse ``type``: an integer >= 0 (a length where 0 means off).")
positive_float = _bounded(float, lambda x: x > 0, "a number > 0", "argparse ``type``: a number > 0 (sizes, seconds).")


OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=.*", re.S)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line. ``key=value`` overrides may also come after the options
    (``t1async soak CONFIG --minutes 5 learner.lr=1e-4``): argparse stops filling a positional
    ``nargs="*"`` at the first option, so such trailing overrides are appended to ``overrides``.

    Raises:
        SystemExit: 2, with one ``t1async: error:`` line, on anything argparse or this does not accept.
    """
    parser = OneLineErrors(prog="t1async", description="Asynchronous RL for MoE terminal agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    wanted = [spec for spec, names in SUBCOMMANDS if command in names] or [spec for spec, _ in SUBCOMMANDS]
    for spec in wanted:  # only the command's own module (torch and Ray stay unimported for status/stop/scale)
        module, func = spec.split(":")
        getattr(importlib.import_module(module), func)(sub)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or not all(OVERRIDE.fullmatch(x) for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


USER_ERRORS = (("t1async.config.errors", "ConfigError"), ("t1async.envs.taskio.task", "TaskError"),
               ("t1async.envs.sandboxes.sandbox", "SandboxUnavailable"), ("t1async.transport.keys", "KeysError"),
               ("t1async.service.control", "ControlError"), ("t1async", "MissingExtra"))
"""``(module, class)`` of each exception type that means bad input."""


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input (reported by the CLI in one line, without a traceback):
    those of :data:`USER_ERRORS` whose module is imported (an error of a module never imported
    cannot have been raised, so ``t1async status`` imports none of them to report its own)."""
    return tuple(getattr(sys.modules[m], name) for m, name in USER_ERRORS if m in sys.modules)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``t1async`` console script; returns the exit status."""
    args = parse(argv)

    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("t1async: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not isinstance(e, user_errors()):
            raise
        print(f"t1async: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
