"""The ``t1async`` command line.

    t1async launch CONFIG [key=value ...]   run the asynchronous RL loop (see t1async.launch)

Bad input (a missing config file, an unknown key, an invalid task folder, a missing sandbox tool)
prints one line ``t1async: error: ...`` and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import sys



def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``t1async`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="t1async", description="Asynchronous RL for MoE terminal agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_launch = sub.add_parser("launch", help="run the asynchronous RL loop")
    p_launch.add_argument("config", help="YAML config, e.g. configs/local.yaml")
    p_launch.add_argument("overrides", nargs="*", help="key=value overrides, e.g. learner.max_steps=4")
    args = parser.parse_args(argv)

    from t1async.launch import launch, user_errors

    try:
        if args.command == "launch":

            summary = launch(args.config, args.overrides)
            if summary.get("interrupted"):
                return 130
            if summary.get("steps", 0) < summary["max_steps"]:
                print(f"t1async: error: the learner stopped after {summary.get('steps', 0)} of {summary['max_steps']} "
                      f"steps; see {summary['run_dir']}/logs/learner.log", file=sys.stderr)
                return 1
            return 0
    except user_errors() as e:
        print(f"t1async: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("t1async: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
