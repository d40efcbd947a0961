"""A minimal agent on the official SDKs, one per dialect (test-only): it asks the model, runs each tool
call the model makes through the episode's sandbox route, sends the results back in the dialect's own
shape, and posts done when a turn has no tool call.

Usage: ``python tests/support/sdk_agent.py {chat,responses,messages} [--stream]``. Environment: what
t1async/rollout/endpoint/agent.py sets (OPENAI_BASE_URL, ANTHROPIC_BASE_URL, T1ASYNC_SANDBOX_URL, ...), and
``SDK_AGENT_LOG``: a JSON-lines file where each round trip is written as the SDK saw it
(``{"calls": [[id, name, arguments]], "text": ...}``), for the tests to check.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

BASH = {"name": "bash", "description": "Run one shell command in the task's sandbox and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
SYSTEM = "You solve the task with the bash tool. Reply without a tool call when the task is done."


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def run(command: str) -> str:
    out = post(os.environ["T1ASYNC_SANDBOX_URL"] + "/exec", {"command": command})
    return f"{out['output']}\n[exit code {out['exit_code']}]"


def log(calls: list, text: str | None) -> None:
    with open(os.environ["SDK_AGENT_LOG"], "a") as f:
        f.write(json.dumps({"calls": calls, "text": text}) + "\n")


def chat(stream: bool) -> None:
    import openai

    client = openai.OpenAI(max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": os.environ["T1ASYNC_INSTRUCTION"]}]
    tools = [{"type": "function", "function": BASH}]
    while True:
        if stream:
            text, calls = "", {}
            for chunk in client.chat.completions.create(model="t1async", messages=messages, tools=tools, stream=True,
                                                        stream_options={"include_usage": True}):
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    for d in choice.delta.tool_calls or []:
                        c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                        c["id"] += d.id or ""
                        c["name"] += (d.function.name or "") if d.function else ""
                        c["arguments"] += (d.function.arguments or "") if d.function else ""
            calls = [calls[k] for k in sorted(calls)]
            message = {"role": "assistant", "content": text or None}
            if calls:
                message["tool_calls"] = [{"id": c["id"], "type": "function",
                                          "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        else:
            msg = client.chat.completions.create(model="t1async", messages=messages, tools=tools).choices[0].message
            text = msg.content
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in msg.tool_calls or []]
            message = msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
        log([[c["id"], c["name"], c["arguments"]] for c in calls], text)
        if not calls:
            return
        messages.append(message)
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c["id"],
                             "content": run(json.loads(c["arguments"])["command"])})


def responses(stream: bool) -> None:
    import openai

    client = openai.OpenAI(max_retries=0)
    items: list = [{"role": "user", "content": os.environ["T1ASYNC_INSTRUCTION"]}]
    tools = [{"type": "function", **BASH}]
    while True:
        kwargs = dict(model="t1async", instructions=SYSTEM, input=items, tools=tools, store=False)
        if stream:
            with client.responses.stream(**kwargs) as s:
                deltas = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
                response = s.get_final_response()
            assert deltas == "".join(o.arguments for o in response.output if o.type == "function_call")
        else:
            response = client.responses.create(**kwargs)
        output = [o.model_dump(exclude_none=True) for o in response.output]
        calls = [o for o in output if o["type"] == "function_call"]
        log([[c["call_id"], c["name"], c["arguments"]] for c in calls], response.output_text or None)
        if not calls:
            return
        items += output
        items += [{"type": "function_call_output", "call_id": c["call_id"],
                   "output": run(json.loads(c["arguments"])["command"])} for c in calls]


def messages(stream: bool) -> None:
    import anthropic

    client = anthropic.Anthropic(max_retries=0)
    history: list = [{"role": "user", "content": os.environ["T1ASYNC_INSTRUCTION"]}]
    tools = [{"name": BASH["name"], "description": BASH["description"], "input_schema": BASH["parameters"]}]
    while True:
        kwargs = dict(model="t1async", system=SYSTEM, messages=history, tools=tools, max_tokens=256)
        if stream:
            with client.messages.stream(**kwargs) as s:
                for _ in s:
                    pass
                msg = s.get_final_message()
        else:
            msg = client.messages.create(**kwargs)
        content = [b.model_dump(exclude_none=True) for b in msg.content]
        calls = [b for b in content if b["type"] == "tool_use"]
        text = "".join(b["text"] for b in content if b["type"] == "text")
        log([[c["id"], c["name"], json.dumps(c["input"])] for c in calls], text or None)
        if not calls:
            return
        history.append({"role": "assistant", "content": content})
        history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": c["id"],
                                                     "content": run(c["input"]["command"])} for c in calls]})


if __name__ == "__main__":
    {"chat": chat, "responses": responses, "messages": messages}[sys.argv[1]]("--stream" in sys.argv[2:])
    post(os.environ["T1ASYNC_DONE_URL"], {})
