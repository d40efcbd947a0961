"""How an assistant turn becomes an action (``env.action_format``), and how its result returns.

Two formats:

- ``command`` (default): the turn's text is the shell command; its output returns as a
  ``tool`` turn (:meth:`ChatTokenizer.render_observation`).
- ``tool_call``: Qwen3's tool-call convention. The system turn declares one tool, ``bash``
  (:data:`BASH_TOOL`, JSON schema ``{"command": string}``); the policy answers
  ``<tool_call>\\n{"name": "bash", "arguments": {"command": "..."}}\\n</tool_call>`` (the tags are
  the special ids, text around the call is allowed); the output returns as a user turn wrapped
  in ``<tool_response>`` (:meth:`ChatTokenizer.render_tool_response`). A turn without a call
  whose text is ``env.end_signal`` (or a call whose command is) ends the episode.

A malformed call is never run and never ends the episode: it becomes an error observation (a
tool turn saying what was wrong and how to call the tool) and a per-turn status code
(:data:`t1async.trajectory.TOOL_CALL_ERRORS`), counted per learner step in metrics.jsonl
``tool_call_errors``. Reasons: ``no_tool_call``, ``unbalanced`` (a ``<tool_call>`` without its
``</tool_call>`` or the reverse), ``bad_json``, ``unknown_tool``, ``bad_arguments`` (missing,
ill-typed or unexpected arguments), ``multiple_calls`` (one call per turn).

Parsing reads the sampled *ids*: a tag is the special id, never the text ``<tool_call>``. The parsing and the
schema check are t1async/rollout/tool_formats.py's (:data:`~t1async.rollout.tool_formats.QWEN3_JSON`), which
also parses the other models' own formats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.tool_formats import BASH_TOOL, QWEN3_JSON, ToolCallProblem, error_message, parse_ids

__all__ = ["BASH_TOOL", "Action", "action_turn_ids", "observation_ids", "parse_action", "prompt_ids",
           "template_turn_ids"]


@dataclass
class Action:
    """What one assistant turn asks for.

    Attributes:
        command: the shell command to run ("" = nothing to run).
        end: the turn is the end signal.
        error: the tool-call error reason (a value of ``TOOL_CALL_ERRORS``), else None.
        message: the error observation shown to the agent ("" when ``error`` is None).
    """

    command: str = ""
    end: bool = False
    error: str | None = None
    message: str = ""


def parse_action(tokenizer: ChatTokenizer, body: Sequence[int], action_format: str, end_signal: str) -> Action:
    """The action of a turn's sampled ids ``body`` (its final stop id removed).

    Never raises for what the policy wrote: a malformed tool call is an :class:`Action` with
    ``error`` set. NUL characters are dropped and the command is stripped, as for ``command``.

    Raises:
        ValueError: unknown ``action_format``.
    """
    if action_format == "command":
        command = tokenizer.decode(body).replace("\x00", "").strip()
        return Action(command=command, end=command == end_signal)
    if action_format != "tool_call":
        raise ValueError(f"action_format {action_format!r} is not 'command' or 'tool_call'")
    call = parse_ids(tokenizer, body, QWEN3_JSON)
    if isinstance(call, ToolCallProblem):
        if call.reason == "no_tool_call" and tokenizer.decode(body).replace("\x00", "").strip() == end_signal:
            return Action(end=True)
        return Action(error=call.reason, message=error_message(call, QWEN3_JSON, end_signal))
    command = call.arguments["command"].replace("\x00", "").strip()
    return Action(command=command, end=command == end_signal)


def prompt_ids(tokenizer: ChatTokenizer, env_cfg, instruction: str) -> list[int]:
    """The episode's opening ids for ``env_cfg.action_format`` (system prompt, instruction, header)."""
    if env_cfg.action_format == "tool_call":
        return tokenizer.render_prompt(env_cfg.tool_system_prompt, instruction, [BASH_TOOL])
    return tokenizer.render_prompt(env_cfg.system_prompt, instruction)


def observation_ids(tokenizer: ChatTokenizer, output: str, action_format: str) -> list[int]:
    """An observation rendered on its own for ``action_format`` (loss mask 0 in the stream)."""
    if action_format == "tool_call":
        return tokenizer.render_tool_response(output)
    return tokenizer.render_observation(output)


def action_turn_ids(tokenizer: ChatTokenizer, command: str, action_format: str) -> list[int]:
    """A demonstration's assistant turn running ``command`` (``<|im_end|>`` included), as the
    template renders it; the end signal is a plain message in both formats."""
    if action_format == "tool_call" and command != "":
        return [*tokenizer.render_tool_call(BASH_TOOL["name"], {"command": command}), tokenizer.im_end_id]
    return [*tokenizer.encode(command), tokenizer.im_end_id]


def template_turn_ids(tokenizer: ChatTokenizer, body: Sequence[int], action_format: str, end_signal: str) -> list[int]:
    """How a chat template re-renders the assistant message of ``body`` (header and
    ``<|im_end|>`` included): ``command``, the decoded text; ``tool_call``, a valid call as
    ``{content}\\n<tool_call>\\n{json.dumps(call)}\\n</tool_call>`` with the content around it
    stripped, anything else as its decoded text with the tool tags read as special ids."""
    text = tokenizer.decode(body)
    if action_format != "tool_call":
        return tokenizer.render_turn("assistant", text)
    head = [tokenizer.im_start_id, *tokenizer.encode("assistant\n")]
    action = parse_action(tokenizer, body, action_format, end_signal)
    body = list(body)
    if action.error is None and tokenizer.tool_call_id in body:
        i, j = body.index(tokenizer.tool_call_id), body.index(tokenizer.tool_call_end_id)
        content = (tokenizer.decode(body[:i]) + tokenizer.decode(body[j + 1:])).strip()
        call = json.loads(tokenizer.decode(body[i + 1: j]).replace("\x00", ""))
        return [*head, *tokenizer.render_tool_call(call["name"], call["arguments"], content), tokenizer.im_end_id]
    return [*head, *tokenizer.encode_tagged(text), tokenizer.im_end_id]
