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

Parsing reads the sampled *ids*: a tag is the special id, never the text ``<tool_call>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from t1async.models.tokenizer import ChatTokenizer

BASH_TOOL = {
    "name": "bash",
    "description": "Run one command in the task's bash shell (working directory /app; the shell keeps its state "
                   "between calls) and return its output.",
    "parameters": {"type": "object",
                   "properties": {"command": {"type": "string", "description": "The shell command to run."}},
                   "required": ["command"]},
}
"""The one tool of the ``tool_call`` format (a JSON-schema function spec)."""

_HOW = ('Call the bash tool as <tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>, '
        "one call per message; reply with `{end}` and no tool call when the task is done.")


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


def _error(reason: str, what: str, end_signal: str) -> Action:
    return Action(error=reason, message=f"[tool call error ({reason}): {what} {_HOW.replace('{end}', end_signal)}]")


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
    opens = [i for i, t in enumerate(body) if t == tokenizer.tool_call_id]
    closes = [i for i, t in enumerate(body) if t == tokenizer.tool_call_end_id]
    if not opens and not closes:
        if tokenizer.decode(body).replace("\x00", "").strip() == end_signal:
            return Action(end=True)
        return _error("no_tool_call", "your message holds no tool call.", end_signal)
    if len(opens) > 1 or len(closes) > 1:
        return _error("multiple_calls", f"your message holds {max(len(opens), len(closes))} tool calls; none was run.",
                      end_signal)
    if len(opens) != len(closes) or closes[0] < opens[0]:
        return _error("unbalanced", "every <tool_call> needs its </tool_call> after it.", end_signal)
    text = tokenizer.decode(body[opens[0] + 1: closes[0]]).replace("\x00", "")
    try:
        call = json.loads(text)
    except json.JSONDecodeError as e:
        return _error("bad_json", f"the call is not JSON ({e}).", end_signal)
    if not isinstance(call, dict):
        return _error("bad_json", f"the call is a JSON {type(call).__name__}, not an object with name and arguments.",
                      end_signal)
    if call.get("name") != BASH_TOOL["name"]:
        return _error("unknown_tool", f"there is no tool {call.get('name')!r}; the only tool is 'bash'.", end_signal)
    extra = sorted(set(call) - {"name", "arguments"})
    args = call.get("arguments")
    if extra or not isinstance(args, dict):
        why = f"unexpected keys {extra}" if extra else "arguments must be a JSON object"
        return _error("bad_arguments", f"{why}.", end_signal)
    if not isinstance(args.get("command"), str):
        what = "missing" if "command" not in args else f"a {type(args['command']).__name__}, not a string"
        return _error("bad_arguments", f"the argument command is {what}.", end_signal)
    if set(args) != {"command"}:
        return _error("bad_arguments", f"unexpected arguments {sorted(set(args) - {'command'})}; bash takes only "
                                       "command.", end_signal)
    command = args["command"].replace("\x00", "").strip()
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
