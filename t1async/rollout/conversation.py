"""One episode's conversation at the token level: the prompt, each sampled turn's action, each observation's ids.

The rollout loop (t1async/rollout/episode.py) holds a :class:`Conversation` and never renders text itself, so
the same loop runs on either renderer of the run (t1async/models/families.py :func:`load_renderer`):

- :class:`ChatMLConversation`: the shipped 4,096-id tokenizer and its ChatML layout
  (t1async/models/tokenizer.py, t1async/rollout/actions.py), the embedded default;
- :class:`TemplateConversation`: a Hugging Face model's own chat template
  (t1async/models/chat_template.py). The prompt is the template's rendering of ``[system, user]`` with the
  tools declared in the template's own way; after each turn the exact sampled ids stay in the stream and only
  the template's rendering of the new observation message is appended (found by rendering with and without
  it, never by re-tokenizing the history). ``template_mismatches`` counts the turns where the template's
  re-render of the whole conversation is not the stream (Qwen3 drops earlier turns' ``<think>`` blocks).

Both parse a turn's action the same way: ``command`` format, the text after the turn's reasoning (a
``<think>...</think>`` block) is the command; ``tool_call``, the tool call in the format the template
declares (t1async/rollout/actions.py for ChatML).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from t1async.config import EnvConfig
from t1async.models.chat_template import ChatTemplateRenderer
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.actions import BASH_TOOL, Action, observation_ids, parse_action, prompt_ids, template_turn_ids
from t1async.rollout.tool_formats import ToolCallFormat, ToolCallProblem, detect, error_message, parse_ids, tag_ids

__all__ = ["Conversation", "ChatMLConversation", "TemplateConversation", "start_conversation", "split_turn",
           "template_tool_format",
           "template_renders_differently", "THINK_END"]

THINK_END = "</think>"
"""Where a reasoning model's thinking ends in a turn's text (Qwen3, Qwen3.5, GLM-4.6): the action follows it."""


class Conversation(Protocol):
    """What the rollout loop asks of an episode's renderer.

    Attributes:
        prompt: the episode's opening ids (system, instruction, the generation prompt).
        stop_ids: the sampler's stop token ids (end-of-turn ids).
        repair_ids: ids appended (loss mask 0) after a turn that did not end with a stop id.
        template_mismatches: turns whose re-render through the template differs from the stream.
    """

    prompt: list[int]
    stop_ids: list[int]
    repair_ids: list[int]
    template_mismatches: int

    def assistant_turn(self, sampled: Sequence[int]) -> Action:
        """Record a sampled turn (its ids as returned, stop id included if sampled) and return its action."""

    def observation(self, output: str, stream: Sequence[int]) -> list[int]:
        """Ids to append for the output of the last turn's action (``stream``: the episode's ids so far,
        the repair included)."""


def split_turn(output_ids: list[int], stop_ids: tuple[int, ...]) -> tuple[list[int], bool]:
    """(body, stopped): a turn's sampled ids without their final stop id, and whether there was one."""
    if output_ids and output_ids[-1] in stop_ids:
        return output_ids[:-1], True
    return list(output_ids), False


def template_renders_differently(tokenizer: ChatTokenizer, turn_ids: list[int], action_format: str = "command",
                                 end_signal: str = "exit") -> bool:
    """Would the chat template render this assistant turn with other ids than the stream holds?

    ``turn_ids`` are the turn's sampled ids (a final ``<|im_end|>`` or ``<|endoftext|>`` included).
    The stream holds ``header + sampled ids (+ <|im_end|> repair when the turn did not end with
    it)``; the template renders the message text, ``render_turn("assistant", decode(body))``.
    They differ when re-encoding the decoded text merges or splits tokens (inside it or across
    the ``assistant\n`` header), when the turn holds a special id (eos, ``<|im_start|>``) or
    bytes that are not UTF-8. With ``action_format`` tool_call the template re-renders a valid call
    from its parsed JSON (:func:`t1async.rollout.actions.template_turn_ids`): other spacing, key order or
    escapes in the sampled JSON count too.
    """
    body, _ = split_turn(turn_ids, (tokenizer.im_end_id, tokenizer.eos_id))
    ended = bool(turn_ids) and turn_ids[-1] == tokenizer.im_end_id
    stream = [tokenizer.im_start_id, *tokenizer.encode("assistant\n"), *turn_ids,
              *([] if ended else tokenizer.end_of_turn_ids)]
    return stream != template_turn_ids(tokenizer, body, action_format, end_signal)


def _strip_stop(sampled: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    return split_turn(list(sampled), tuple(stop_ids))[0]


class ChatMLConversation:
    """The shipped tokenizer's ChatML episode (t1async/rollout/actions.py): see :class:`Conversation`."""

    def __init__(self, tokenizer: ChatTokenizer, env_cfg: EnvConfig, instruction: str) -> None:
        self.tok, self.env_cfg = tokenizer, env_cfg
        self.prompt = prompt_ids(tokenizer, env_cfg, instruction)
        self.stop_ids = [tokenizer.im_end_id, tokenizer.eos_id]
        self.repair_ids = tokenizer.end_of_turn_ids
        self.template_mismatches = 0

    def assistant_turn(self, sampled: Sequence[int]) -> Action:
        fmt, end = self.env_cfg.action_format, self.env_cfg.end_signal
        self.template_mismatches += template_renders_differently(self.tok, list(sampled), fmt, end)
        return parse_action(self.tok, _strip_stop(sampled, self.stop_ids), fmt, end)

    def observation(self, output: str, stream: Sequence[int]) -> list[int]:
        return observation_ids(self.tok, output, self.env_cfg.action_format)


class TemplateConversation:
    """A Hugging Face chat template's episode: see :class:`Conversation` and the module docstring.

    The history is kept as messages whose assistant contents are the decoded sampled ids (stop id removed),
    so the template renders each observation after exactly what was sampled.

    With ``env.action_format`` tool_call the bash tool is declared through the template, and a turn's call is
    parsed in the format the template declares (t1async/rollout/tool_formats.py), from the ids after the
    turn's reasoning: a malformed call becomes an error observation, as in the ChatML loop.

    Raises:
        TemplateError: the template cannot render the prompt (at construction) or an observation.
        ValueError: tool_call and a template with no tool-call format t1async knows, or tags that are not
            single token ids (:func:`template_tool_format`).
    """

    def __init__(self, renderer: ChatTemplateRenderer, env_cfg: EnvConfig, instruction: str) -> None:
        self.r, self.env_cfg = renderer, env_cfg
        fmt = env_cfg.action_format
        self.call_format = template_tool_format(renderer) if fmt == "tool_call" else None
        think_end = renderer.tokenizer.convert_tokens_to_ids(THINK_END)
        self._think_end = think_end if isinstance(think_end, int) and renderer.decode([think_end]) == THINK_END else None
        self.tools: list[dict] = [BASH_TOOL] if fmt == "tool_call" else []
        system = env_cfg.tool_system_prompt if fmt == "tool_call" else env_cfg.system_prompt
        self.messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": instruction}]
        self.prompt = renderer.render_prompt(system, instruction, self.tools)
        self.stop_ids = renderer.end_of_turn_ids
        self.repair_ids = renderer.end_of_turn_ids[:1]
        self._mismatches_before = renderer.template_mismatches  # the renderer counts over every episode

    @property
    def template_mismatches(self) -> int:
        return self.r.template_mismatches - self._mismatches_before

    def assistant_turn(self, sampled: Sequence[int]) -> Action:
        body = _strip_stop(sampled, self.stop_ids)
        text = self.r.decode(body)
        self.messages.append({"role": "assistant", "content": text})
        end = self.env_cfg.end_signal
        if self.call_format is None:
            command = text.rsplit(THINK_END, 1)[-1].replace("\x00", "").strip()
            return Action(command=command, end=command == end)
        if self._think_end is not None and self._think_end in body:  # a call inside the reasoning is not a call
            body = body[len(body) - body[::-1].index(self._think_end):]
        call = parse_ids(self.r, body, self.call_format)
        if isinstance(call, ToolCallProblem):
            if call.reason == "no_tool_call" and self.r.decode(body).replace("\x00", "").strip() == end:
                return Action(end=True)
            return Action(error=call.reason, message=error_message(call, self.call_format, end))
        command = str(call.arguments["command"]).replace("\x00", "").strip()
        return Action(command=command, end=command == end)

    def observation(self, output: str, stream: Sequence[int]) -> list[int]:
        message = {"role": "tool", "content": output}
        ids = self.r.render_observation(self.messages, message, self.tools, stream=stream)
        self.messages.append(message)
        return ids


def template_tool_format(renderer: ChatTemplateRenderer) -> ToolCallFormat:
    """The tool-call format ``renderer``'s template declares, checked to have single-id tags.

    Raises:
        ValueError: one line: no known format, or tags that are not single added-token ids.
    """
    fmt = detect(renderer.tokenizer.chat_template)
    tag_ids(renderer, fmt)
    return fmt


def start_conversation(renderer: ChatTokenizer | ChatTemplateRenderer, env_cfg: EnvConfig,
                       instruction: str) -> ChatMLConversation | TemplateConversation:
    """The conversation of one episode of ``instruction`` on the run's renderer.

    Raises:
        TypeError: ``renderer`` is neither renderer.
    """
    if isinstance(renderer, ChatTokenizer):
        return ChatMLConversation(renderer, env_cfg, instruction)
    if isinstance(renderer, ChatTemplateRenderer):
        return TemplateConversation(renderer, env_cfg, instruction)
    raise TypeError(f"no conversation for a {type(renderer).__name__}; give a ChatTokenizer or a ChatTemplateRenderer")
