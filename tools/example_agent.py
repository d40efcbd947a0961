"""A small Terminus-style agent for ``rollout.agent: external``: the official ``openai`` client
against t1async's OpenAI-compatible endpoint, commands run through its sandbox API.

Loop: system prompt + the task's instruction; each turn asks for one completion with a ``bash``
tool declared; every tool call is run with ``POST $T1ASYNC_SANDBOX_URL/exec`` and its output sent
back as a ``tool`` message; a reply without a tool call gets a short reminder (or, when it is
``exit``, ends the episode with ``POST $T1ASYNC_DONE_URL``). The history is only ever appended to,
so every request continues the previous completion (the endpoint's records stay one exact segment).

Environment (set by the rollout actor): ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``,
``T1ASYNC_SANDBOX_URL``, ``T1ASYNC_DONE_URL``, ``T1ASYNC_INSTRUCTION``, ``T1ASYNC_MAX_TURNS``.
Run it as ``rollout.agent_command="python tools/example_agent.py"``.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

import openai

SYSTEM = ("You operate a Linux shell to finish the task. Run one shell command per message with the bash tool; "
          "its output comes back as the tool response. The working directory is /app. Reply with `exit` and no "
          "tool call when the task is done.")
BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run one command in the task's bash shell and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
REMINDER = "No tool call found. Call the bash tool to run a command, or reply `exit` when the task is done."


def post(url: str, body: dict) -> dict:
    """POST JSON, return the JSON answer (urllib.error.HTTPError on a non-2xx status)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def main() -> int:
    client = openai.OpenAI(max_retries=0, timeout=300)
    sandbox, done = os.environ["T1ASYNC_SANDBOX_URL"], os.environ["T1ASYNC_DONE_URL"]
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": os.environ["T1ASYNC_INSTRUCTION"]}]
    for _ in range(int(os.environ.get("T1ASYNC_MAX_TURNS", "10"))):
        try:
            reply = client.chat.completions.create(model="t1async", messages=messages, tools=[BASH])
        except openai.APIStatusError as e:  # the episode is over (turns spent, context full): stop
            print(f"endpoint refused: {e.status_code} {e.message}", file=sys.stderr)
            return 0
        except openai.APIConnectionError as e:  # the rollout actor is gone (the run stopped)
            print(f"endpoint unreachable: {e}", file=sys.stderr)
            return 1
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not msg.tool_calls:
            if (msg.content or "").strip() == "exit":
                post(done, {})
                return 0
            messages.append({"role": "user", "content": REMINDER})
            continue
        for call in msg.tool_calls:
            try:
                command = json.loads(call.function.arguments).get("command")
            except (json.JSONDecodeError, AttributeError):
                command = None
            if call.function.name != "bash" or not isinstance(command, str):
                output = "error: call the bash tool with a string argument `command`."
            else:
                try:
                    output = post(sandbox + "/exec", {"command": command})["output"]
                except urllib.error.HTTPError as e:  # 409: the episode ended meanwhile
                    print(f"sandbox refused: {e.code} {e.read()[:300]!r}", file=sys.stderr)
                    return 0
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return 0


if __name__ == "__main__":
    sys.exit(main())
