"""A scripted policy behind the Sampler protocol (test-only, a fake edge: the tiny models on CPU emit noise).

It answers each request with the next of a task's oracle commands (the lines of its
``solution/solve.sh``) as a bash tool call in the model's own template format, and, once they are
spent, a plain text turn: the agent then sees no tool call and ends. Log-probs and routed experts
have the sampler's exact shapes (routing row of position p is p % E), so a shifted or re-tokenized
stream would show in the trajectory.
"""

from __future__ import annotations

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

    def generate(self, input_ids, sampling_params, *, routed_experts_start_len=0):
        if self.commands:
            out = [*self.tok.render_tool_call(self.tool, {self.argument: self.commands.pop(0)}), self.tok.im_end_id]
        else:
            out = [*self.tok.encode(self.final), self.tok.im_end_id]
        self.calls.append(list(input_ids))
        self.outputs.append(out)
        positions = np.arange(routed_experts_start_len, len(input_ids) + len(out) - 1)
        rows = np.broadcast_to((positions % E)[:, None, None], (positions.size, L, K)).astype(np.int32)
        return SamplerResponse(output_ids=out, logprobs=[-0.5] * len(out), routed_experts=rows, finish_reason="stop",
                               weight_version=7)
