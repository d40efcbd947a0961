"""Readable episode transcripts: what the policy actually did, one Markdown file per learner step.

``RUN_DIR/episodes/step_NNNNNN.md`` holds the first ``learner.episodes_per_step`` trajectories of
that step's batch: the task, the instruction (the prompt's user message), each command the policy
sampled and the output it saw (decoded from the trajectory's exact token stream: what was
trained on, not a re-rendering), how each turn ended, and the verifier's verdict per test. Only
the newest :data:`KEEP_FILES` files are kept.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from t1async.models.chat_template import ChatRenderer
from t1async.models.tokenizer import ChatTokenizer
from t1async.trajectory import TURN_STATUS, Trajectory

KEEP_FILES = 200
_SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>")


def _clean(text: str) -> str:
    for s in _SPECIAL:
        text = text.replace(s, "")
    return text.strip()


def _role_body(text: str, role: str) -> str:
    """The body of the first ``<|im_start|>ROLE\\n ... <|im_end|>`` message in ``text`` ('' if none)."""
    head = f"<|im_start|>{role}\n"
    start = text.find(head)
    if start < 0:
        return ""
    end = text.find("<|im_end|>", start)
    return text[start + len(head): end if end >= 0 else None]


def render(traj: Trajectory, tok: ChatRenderer) -> str:
    """One trajectory as Markdown (task, instruction, commands and outputs, verdict)."""
    ids = traj.token_ids
    turns = traj.turn_offsets
    prompt = tok.decode(ids[: int(turns[0][0])]) if len(turns) else tok.decode(ids)
    lines = [f"## {traj.task}  (trajectory {traj.trajectory_id}, actor {traj.actor_id})", "",
             "**Instruction**", "", "```", _clean(_role_body(prompt, "user")), "```", ""]
    for i, (s, e) in enumerate(turns):
        command = _clean(tok.decode(ids[int(s): int(e)]))
        nxt = int(turns[i + 1][0]) if i + 1 < len(turns) else len(ids)
        after = tok.decode(ids[int(e): nxt])
        output = _role_body(after, "tool")
        if not output and "<tool_response>" in after:  # env.action_format tool_call: a user turn (Qwen3)
            output = _role_body(after, "user").removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")
        status = int(traj.turn_status[i]) if traj.turn_status is not None else 0
        versions = sorted({int(v) for v in np.unique(traj.versions[int(s): int(e)])})
        note = f" ({TURN_STATUS.get(status, status)})" if status else ""
        lines += [f"**Turn {i + 1}**{note}, weights v{','.join(map(str, versions))}", "", "```console",
                  f"$ {command}", output.rstrip(), "```", ""]
    verdict = "resolved" if traj.resolved else "not resolved"
    lines += [f"**Verdict**: {verdict}, {traj.passed}/{traj.total} tests passed, reward {traj.reward:g}, "
              f"episode ended by {traj.finish_reason}" + (f", verifier error: {traj.verifier_error}"
                                                          if traj.verifier_error else ""), ""]
    lines += [f"- {'PASS' if ok else 'FAIL'} {name}" for name, ok in traj.tests]
    return "\n".join(lines) + "\n"


def write_transcripts(folder: Path, step: int, batch: list[Trajectory], n: int,
                      tokenizer: ChatRenderer | None = None) -> Path | None:
    """Write the first ``n`` of ``batch`` to ``folder/step_NNNNNN.md``; keep the newest files.

    Returns:
        The file written, or None when ``n`` is 0 or the batch is empty.
    """
    if n <= 0 or not batch:
        return None
    tok = tokenizer or ChatTokenizer.load()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.md"
    path.write_text(f"# Step {step}\n\n" + "\n---\n\n".join(render(t, tok) for t in batch[:n]))
    for old in sorted(folder.glob("step_*.md"))[:-KEEP_FILES]:
        old.unlink(missing_ok=True)
    return path
