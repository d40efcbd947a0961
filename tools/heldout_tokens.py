"""Can a policy trained from scratch on the demonstrations even emit the held-out commands' tokens?

    python tools/heldout_tokens.py TASKS [--model DIR]

TASKS is a ``t1async bench learning`` split (its ``--out`` folder's ``tasks/``, holding ``sft/`` and
``heldout/``); ``--model`` a model folder whose tokenizer is used (default: the built-in tokenizer). A tiny
model initialised at random learns an output row only for the ids its demonstrations contain, so a held-out
command that needs an id no demonstration holds is out of reach however well SFT fits; with a 151,936-id
vocabulary, whole words are single ids and that could happen where a 4,096-id vocabulary splits them into
seen pieces. Prints one JSON object: for the tokenizer, the held-out oracle commands' tokens, how many
appear nowhere in the demonstration tasks' instructions and commands, and how many held-out tasks need one.
Commands are each ``solution/solve.sh``'s lines after its ``set -e`` / ``cd`` preamble.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

PREAMBLE = ("#!", "set -e", "cd /app")


def oracle_commands(task: Path) -> list[str]:
    """The commands of ``task``'s ``solution/solve.sh`` after its preamble (shebang, ``set -e``, ``cd /app``)."""
    lines = (task / "solution" / "solve.sh").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith(PREAMBLE)]


def unseen(tasks: Path, encode: Callable[[str], list[int]]) -> dict:
    """Counts of held-out command ids that no demonstration task's instruction or commands contain."""
    seen: set[int] = set()
    for task in sorted((tasks / "sft").iterdir()):
        seen.update(encode((task / "instruction.md").read_text()))
        for command in oracle_commands(task):
            seen.update(encode(command))
    total = missing = needing = 0
    held = sorted((tasks / "heldout").iterdir())
    for task in held:
        ids = [i for command in oracle_commands(task) for i in encode(command)]
        gone = [i for i in ids if i not in seen]
        total, missing, needing = total + len(ids), missing + len(gone), needing + bool(gone)
    return {"heldout_tasks": len(held), "command_tokens": total, "tokens_no_demonstration_holds": missing,
            "tasks_needing_one": needing, "demonstration_vocabulary": len(seen)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tasks", type=Path, help="a bench learning split: the folder holding sft/ and heldout/")
    p.add_argument("--model", default="", help="model folder whose tokenizer to use (default: the built-in one)")
    args = p.parse_args(argv)
    lacking = [d for d in ("sft", "heldout") if not (args.tasks / d).is_dir()]
    if lacking:
        p.error(f"{args.tasks} has no {' or '.join(f'{d}/' for d in lacking)}: pass a bench learning split, "
                "the tasks/ folder of t1async bench learning's --out")
    if args.model:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    else:
        from t1async.models.tokenizer import ChatTokenizer

        encode = ChatTokenizer.load().encode
    print(json.dumps({"tokenizer": args.model or "built-in", **unseen(args.tasks, encode)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
