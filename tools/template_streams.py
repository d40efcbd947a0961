"""Token by token: the stream t1async trains on for an episode vs the model's own template's rendering of it.

    python tools/template_streams.py MODEL_DIR [--action-format command|tool_call] [--kwargs JSON]

The episode is :func:`t1async.commands.model.tool_episode`'s two commands (``ls /app``, ``ls /app | wc -l``),
their outputs and the end signal, built as ``t1async sft`` builds a demonstration and the rollout loop builds an
episode (the same :class:`~t1async.rollout.conversation.TemplateConversation`). The reference is transformers'
``apply_chat_template(messages, tokenize=True)`` of the same messages with the same template arguments: what a
checkpoint trained on that template saw. Prints one JSON object: both lengths, the first differing position,
and each differing stretch as text (``ours`` / ``template``), so a difference is read, not guessed.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys


def main(argv: list[str] | None = None) -> int:
    from t1async.commands.sft import template_demonstration_turns  # torch
    from t1async.config import EnvConfig, ModelConfig
    from t1async.config.model_folder import resolve_model
    from t1async.models.families import load_renderer  # torch
    from t1async.rollout.actions import BASH_TOOL
    from t1async.rollout.conversation import TemplateConversation

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="model folder (model.path)")
    p.add_argument("--action-format", choices=("command", "tool_call"), default="command")
    p.add_argument("--kwargs", default="{}", help="model.chat_template_kwargs as JSON")
    a = p.parse_args(argv)
    r = load_renderer(resolve_model(ModelConfig(path=a.model, chat_template_kwargs=json.loads(a.kwargs))))
    env = EnvConfig(action_format=a.action_format)
    instruction, commands, outputs = "Count the files in /app.", ["ls /app", "ls /app | wc -l"], ["a.txt\nb.txt", "2"]
    conv = TemplateConversation(r, env, instruction)
    ours = list(conv.prompt)
    for turn, output in zip(template_demonstration_turns(r, env, instruction, commands), [*outputs, None]):
        ours += turn
        action = conv.assistant_turn(turn)
        if output is not None and not action.end:
            ours += conv.observation(output, ours)
    tool = a.action_format == "tool_call"
    messages = [{"role": "system", "content": env.tool_system_prompt if tool else env.system_prompt},
                {"role": "user", "content": instruction}]
    for c, out in zip(commands, outputs):
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": c}}}]} if tool
            else {"role": "assistant", "content": c})
        messages.append({"role": "tool", "content": out})
    messages.append({"role": "assistant", "content": env.end_signal})
    ref = r.tokenizer.apply_chat_template(messages, tools=[{"type": "function", "function": BASH_TOOL}] if tool else None,
                                          tokenize=True, return_dict=False, **r.template_kwargs)
    ref = list(ref)
    diffs = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=ours, b=ref, autojunk=False).get_opcodes():
        if op != "equal":
            diffs.append({"at": i1, "ours": r.decode(ours[i1:i2]), "template": r.decode(ref[j1:j2])})
    first = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), min(len(ours), len(ref)))
    json.dump({"model": a.model, "action_format": a.action_format, "kwargs": r.template_kwargs,
               "ours_tokens": len(ours), "template_tokens": len(ref), "first_difference": first,
               "differences": diffs}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
