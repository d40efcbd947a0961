"""A scripted policy behind the Sampler protocol (test-only, a fake edge: the tiny models on CPU emit noise).

It answers each request with the next of a task's oracle commands (the lines of its
``solution/solve.sh``) as a bash tool call in the model's own template format, and, once they are
spent, a plain text turn: the agent then sees no tool call and ends. Log-probs and routed experts
have the sampler's exact shapes (routing row of position p is p % E), so a shifted or re-tokenized
stream would show in the trajectory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from t1async.models.tokenizer import ChatTokenizer
from t1async.sampling.sampler_client import SamplerResponse

E, L, K = 4, 2, 2


def oracle_commands(task_dir: Path) -> list[str]:
    """The commands of a task's ``solution/solve.sh``, one per line (comments and blank lines skipped)."""
    lines = (task_dir / "solution" / "solve.sh").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


class OraclePolicy:
    """Emits ``commands`` as calls of ``tool`` (its ``argument``: bash's ``command``, Codex's
    ``exec_command`` ``cmd``), one per turn, then ``final`` as text, or, given ``final_call``, that command
    as one more call (mini-swe-agent ends on its submit command, not on text).

    Attributes:
        calls: every request's prompt ids, in order.
        outputs: every answer's sampled ids, in order.
    """

    def __init__(self, tok: ChatTokenizer, commands: list[str], final: str = "The task is done.", tool: str = "bash",
                 argument: str = "command", final_call: str | None = None):
        self.tok, self.commands, self.final, self.tool, self.argument = tok, list(commands), final, tool, argument
        if final_call is not None:
            self.commands.append(final_call)
        self.calls: list[list[int]] = []
        self.outputs: list[list[int]] = []

    def begin_episode(self) -> None:
        """(The rollout actor calls it before each episode.)"""

    def answer(self) -> list[int]:
        """The sampled ids of the next turn."""
        if self.commands:
            return [*self.tok.render_tool_call(self.tool, {self.argument: self.commands.pop(0)}), self.tok.im_end_id]
        return [*self.tok.encode(self.final), self.tok.im_end_id]

    def generate(self, input_ids, sampling_params, *, routed_experts_start_len=0):
        out = self.answer()
        self.calls.append(list(input_ids))
        self.outputs.append(out)
        positions = np.arange(routed_experts_start_len, len(input_ids) + len(out) - 1)
        rows = np.broadcast_to((positions % E)[:, None, None], (positions.size, L, K)).astype(np.int32)
        return SamplerResponse(output_ids=out, logprobs=[-0.5] * len(out), routed_experts=rows, finish_reason="stop",
                               weight_version=7)


class TerminusPolicy(OraclePolicy):
    """The oracle commands in the reply format of the terminus harness (t1async/rollout/terminus.py): one
    JSON reply per command (its keystrokes end with a newline, a short wait), then ``task_complete`` true
    twice (the claim and its confirmation), as plain text of the shipped tokenizer."""

    def __init__(self, tok: ChatTokenizer, commands: list[str], duration: float = 0.3):
        super().__init__(tok, commands)
        self.duration = duration
        self.completes = 0

    def answer(self) -> list[int]:
        if self.commands:
            reply = {"analysis": "The terminal is ready.", "plan": "Run the next step.",
                     "commands": [{"keystrokes": self.commands.pop(0) + "\n", "duration": self.duration}],
                     "task_complete": False}
        else:
            self.completes += 1
            reply = {"analysis": "Every step ran.", "plan": "Finish.", "commands": [], "task_complete": True}
        return [*self.tok.encode(json.dumps(reply)), self.tok.im_end_id]


class TextReplies(OraclePolicy):
    """Answers the given texts in order (then the last one again), each ended by the end-of-turn id."""

    def __init__(self, tok: ChatTokenizer, texts: list[str]):
        super().__init__(tok, [])
        self.texts = list(texts)

    def answer(self) -> list[int]:
        text = self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]
        return [*self.tok.encode(text), self.tok.im_end_id]
