"""A Terminus-style tmux harness (``rollout.agent=terminus``): the model types keystrokes into a terminal.

Written here from the published description of Terminal-Bench's reference agent (Harbor's
Terminus-2); no code or prompt text of it is used. This file is one program that runs INSIDE the
episode's sandbox (t1async/rollout/harnesses.py ships it there and starts it with the sandbox's
``python3``), so it uses the standard library only. Protocol:

- The model answers each turn with one JSON object (:func:`parse_reply`): ``analysis`` (what it sees),
  ``plan`` (what it will do), ``commands`` (a list of ``{"keystrokes": str, "duration": seconds}``)
  and ``task_complete`` (bool). Keystrokes are typed into a tmux pane as they are (a newline presses
  Enter); a command whose keystrokes are exactly one tmux key name (``C-c``, ``Escape``, ``Up``, ...)
  presses that key. After each command the harness waits ``duration`` seconds (at most
  ``--max-wait``), then reads the pane.
- What the model sees next (:class:`Screen`): the output that appeared since its last look (the
  pane's history compared line by line), or the whole visible screen when the earlier output is no
  longer there (cleared, a full-screen program, history overflow); past ``--max-observation-chars``
  the middle is cut and a marker says how much (:func:`truncate`).
- A shell that exits (the model typed ``exit`` or C-d) is replaced by a new one, and the model is told.
- ``task_complete: true`` is confirmed: the harness asks once more, and only a second
  ``task_complete: true`` in the very next reply ends the episode.
- A reply that cannot be used (no JSON object, bad JSON, missing or wrong fields) is not a crash: the
  model gets an error observation naming what was wrong and the count grows (``parse_errors``).

It speaks OpenAI Chat Completions (``POST {base_url}/chat/completions``, streamed with ``--stream``
or not) with plain ``urllib``, so every completion is recorded by the endpoint's one recorder; the
assistant message it sends back is exactly the one it received (so the next prompt continues the
sampled ids). It ends on a confirmed task_complete (``end_signal``), its turn budget
(``max_turns``), its time budget (``timeout``), the endpoint ending the episode (HTTP 409:
``episode_over``) or failing (``endpoint_error``), and prints one last line ``{"terminus": {...}}``
(the reason, turns, parse errors by reason, commands typed, observations cut, shells restarted) that the rollout actor
reads (:func:`outcome`).

Bad input: tmux missing in the sandbox exits with status 127 and one line naming
``apt-get install tmux``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

TMUX_INSTALL = "apt-get install tmux"
SUMMARY_KEY = "terminus"
HISTORY_LINES = 20000
"""Scroll-back the pane keeps (the incremental output compares it; a longer output shows the screen)."""

SYSTEM_PROMPT = """You operate a Linux terminal to solve a task. The terminal is a tmux pane running a shell; \
you act by typing keystrokes into it and reading what appears on the screen.

Every reply must be exactly one JSON object, with nothing before or after it, of this form:
{
  "analysis": "what the screen shows and what it means for the task",
  "plan": "what you will do next and why",
  "commands": [
    {"keystrokes": "ls -la\\n", "duration": 0.5}
  ],
  "task_complete": false
}

Rules:
- "keystrokes" is typed exactly as written. End a shell command with "\\n" to press Enter.
- A "keystrokes" value that is exactly one key name presses that key: C-c (interrupt), C-d, C-z, \
Escape, Tab, Enter, BSpace, Up, Down, Left, Right, Home, End, PageUp, PageDown, F1 to F12, or C-/M- \
followed by a character.
- "duration" is how many seconds to wait after the keystrokes before the screen is read again \
(0.1 for a quick command, more for installs or builds; at most {max_wait:g}). You can always wait \
longer by sending no commands.
- The commands run one after another in the same terminal; you see the screen after the last one.
- When the task is solved, set "task_complete" to true. You will be asked to confirm; confirm with \
another reply whose "task_complete" is true.
"""


# ---------------------------------------------------------------------------------------------- replies

class ReplyError(ValueError):
    """A reply the harness cannot act on.

    Attributes:
        reason: ``no_tool_call`` (no JSON object), ``bad_json`` (an object that does not parse) or
            ``bad_arguments`` (a field missing or of the wrong type): the names of t1async's
            tool-call error counters (t1async/trajectory.py ``TOOL_CALL_ERRORS``).
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Command:
    """One entry of ``commands``: keystrokes to type, then seconds to wait."""

    keystrokes: str
    duration: float = 1.0


@dataclass
class Reply:
    """One parsed model reply."""

    analysis: str
    plan: str
    commands: list[Command] = field(default_factory=list)
    task_complete: bool = False


def parse_reply(text: str) -> Reply:
    """The reply of one turn, from the model's text.

    The JSON object is the text from its first ``{`` (a Markdown code fence or words around it are
    tolerated); it must hold ``analysis`` and ``plan`` (strings), ``commands`` (a list of objects
    with a string ``keystrokes`` and an optional number ``duration`` >= 0; may be empty) and an
    optional boolean ``task_complete`` (default false).

    Raises:
        ReplyError: with the reason and a one-line message naming what is wrong.
    """
    start = text.find("{")
    if start < 0:
        raise ReplyError("no_tool_call", "the reply holds no JSON object")
    try:
        obj, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError as e:
        raise ReplyError("bad_json", f"the JSON object does not parse: {e.msg} at character {e.pos}") from None
    for key in ("analysis", "plan"):
        if not isinstance(obj.get(key), str):
            raise ReplyError("bad_arguments", f'"{key}" is missing or not a string')
    raw = obj.get("commands")
    if not isinstance(raw, list):
        raise ReplyError("bad_arguments", '"commands" is missing or not a list')
    commands = []
    for k, c in enumerate(raw):
        if not isinstance(c, dict) or not isinstance(c.get("keystrokes"), str):
            raise ReplyError("bad_arguments", f'commands[{k}] is not an object with a string "keystrokes"')
        duration = c.get("duration", 1.0)
        if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not duration >= 0:
            raise ReplyError("bad_arguments", f'commands[{k}].duration is not a number of seconds >= 0')
        commands.append(Command(c["keystrokes"], float(duration)))
    complete = obj.get("task_complete", False)
    if not isinstance(complete, bool):
        raise ReplyError("bad_arguments", '"task_complete" is not true or false')
    return Reply(obj["analysis"], obj["plan"], commands, complete)


def turn_problem(text: str) -> str | None:
    """The error reason of a reply's text (see :class:`ReplyError`), or None when it can be acted on.
    The rollout actor marks such turns with t1async's tool-call error codes."""
    try:
        parse_reply(text)
    except ReplyError as e:
        return e.reason
    return None


def outcome(output: str) -> dict | None:
    """The summary this program printed last (``{"ended", "turns", ...}``), read from its output; None
    when there is none (it crashed or was killed)."""
    for line in reversed(output.splitlines()):
        if line.startswith('{"' + SUMMARY_KEY + '"'):
            try:
                return json.loads(line)[SUMMARY_KEY]
            except (json.JSONDecodeError, KeyError, TypeError):
                return None
    return None


# ---------------------------------------------------------------------------------------------- terminal

KEY_NAME = re.compile(r"(?:[CM]-.|C-M-.|Enter|Escape|Tab|BTab|BSpace|Space|Up|Down|Left|Right|Home|End|PageUp|"
                      r"PageDown|PPage|NPage|IC|DC|F(?:[1-9]|1[0-2]))")
"""Keystrokes that are exactly one of these are pressed as that tmux key."""


def truncate(text: str, limit: int) -> str:
    """``text`` with its middle replaced by a marker when longer than ``limit`` characters."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters left out ...]\n{text[-tail:]}"


class Tmux:
    """One tmux server and session of this harness (its own socket, no user configuration).

    Args:
        socket: socket name (``tmux -L``).
        shell: the shell the pane runs.
        cwd: the pane's working folder.
        width, height: the pane's size in characters.
    """

    def __init__(self, socket: str, shell: str, cwd: str, width: int = 160, height: int = 48):
        self.base = ["tmux", "-L", socket, "-f", "/dev/null"]
        self._start = ("start-server", ";", "set-option", "-g", "history-limit", str(HISTORY_LINES), ";",
                       "new-session", "-d", "-s", "main", "-x", str(width), "-y", str(height), "-c", cwd, shell)
        self._run(*self._start)

    def revive(self) -> bool:
        """Start a new shell when the pane's has exited (the model typed ``exit``, or C-d); True when it
        had to (the model is told)."""
        if subprocess.run([*self.base, "has-session", "-t", "main"], capture_output=True, timeout=30).returncode == 0:
            return False
        self._run(*self._start)
        self.wait_ready()
        return True

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the shell has drawn something (its prompt): keystrokes typed while it starts are
        dropped when it takes over the terminal. Gives up quietly after ``timeout_s`` (an empty prompt)."""
        deadline = time.monotonic() + timeout_s
        while not self.screen() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _run(self, *args: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}  # (the pane's shell inherits it)
        out = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=30, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"tmux {args[0]} failed: {out.stderr.strip()}")
        return out.stdout

    def send(self, keystrokes: str) -> None:
        """Type ``keystrokes`` literally (in pieces under tmux's command size), or press one key."""
        if KEY_NAME.fullmatch(keystrokes):
            self._run("send-keys", "-t", "main", keystrokes)
            return
        for i in range(0, len(keystrokes), 2000):
            self._run("send-keys", "-t", "main", "-l", keystrokes[i:i + 2000])

    def history(self) -> list[str]:
        """Every line of the pane, scroll-back included, trailing blank lines dropped."""
        return _rstrip_lines(self._run("capture-pane", "-p", "-J", "-t", "main", "-S", "-"))

    def screen(self) -> list[str]:
        """The visible lines of the pane, trailing blank lines dropped."""
        return _rstrip_lines(self._run("capture-pane", "-p", "-t", "main"))

    def close(self) -> None:
        """Stop the tmux server (and the shell in it)."""
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=30)


def _rstrip_lines(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


class Screen:
    """What the model is shown after each step: the output since its last look, when the pane's history
    still starts with what it saw (its last line, the prompt it typed at, shown again), else the
    visible screen."""

    def __init__(self, term: Tmux):
        self.term = term
        self.seen: list[str] = []

    def observe(self) -> str:
        """The observation of the pane as it is now (and remember it as seen)."""
        lines = self.term.history()
        keep = len(self.seen) - 1
        if self.seen and len(lines) >= len(self.seen) and lines[:keep] == self.seen[:keep]:
            text = "New terminal output:\n" + "\n".join(lines[keep:])
        else:
            text = "Current terminal screen:\n" + "\n".join(self.term.screen())
        self.seen = lines
        return text


# ---------------------------------------------------------------------------------------------- endpoint

class EndpointError(RuntimeError):
    """The endpoint refused or failed a completion (``status`` 0: no answer at all)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def complete(base_url: str, api_key: str, model: str, messages: list[dict], stream: bool,
             timeout_s: float) -> dict:
    """One Chat Completions call: the assistant message (``content``, and ``tool_calls`` when the model
    wrote some), assembled from the ``chat.completion.chunk`` events when ``stream``.

    Raises:
        EndpointError: an HTTP error (its status and the API's error message) or no connection.
    """
    body = json.dumps({"model": model, "messages": messages, "stream": stream}).encode()
    req = urllib.request.Request(f"{base_url.rstrip('/')}/chat/completions", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=max(1.0, timeout_s)) as resp:
            try:
                return json.loads(resp.read())["choices"][0]["message"] if not stream else _read_stream(resp)
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise EndpointError(0, f"the endpoint's answer is not a chat completion: {e!r}") from None
    except urllib.error.HTTPError as e:
        raw = e.read().decode(errors="replace")
        try:
            message = json.loads(raw)["error"]["message"]
        except (json.JSONDecodeError, KeyError, TypeError):
            message = raw[:300]
        raise EndpointError(e.code, message) from None
    except (urllib.error.URLError, OSError) as e:
        raise EndpointError(0, str(e)) from None


def _read_stream(resp) -> dict:
    content: list[str] = []
    calls: dict[int, dict] = {}
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        for choice in json.loads(data).get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                content.append(delta["content"])
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc.get("index", 0), {"id": "", "type": "function",
                                                             "function": {"name": "", "arguments": ""}})
                call["id"] = tc.get("id") or call["id"]
                fn = tc.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
    msg: dict = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    return msg


# ---------------------------------------------------------------------------------------------- the loop

@dataclass
class Settings:
    """One episode's settings (the command-line flags)."""

    base_url: str
    api_key: str
    model: str
    instruction: str
    stream: bool = False
    max_turns: int = 50
    time_budget_s: float = 3600.0
    max_wait_s: float = 60.0
    max_observation_chars: int = 10000
    socket: str = "t1async-terminus"
    cwd: str = "."


def run(s: Settings, out=sys.stdout) -> dict:
    """Drive one episode; returns the summary (also printed last, as one JSON line, by :func:`main`)."""
    deadline = time.monotonic() + s.time_budget_s
    shell = os.environ.get("SHELL") if os.environ.get("SHELL") and shutil.which(os.environ["SHELL"]) else (
        shutil.which("bash") or "/bin/sh")
    term = Tmux(s.socket, shell, s.cwd)
    stats: dict = {"ended": None, "turns": 0, "parse_errors": {}, "commands": 0, "observations_cut": 0,
                   "task_complete_asked": 0, "shell_restarts": 0}
    try:
        term.wait_ready()
        screen = Screen(term)
        first = screen.observe()
        messages = [{"role": "system", "content": SYSTEM_PROMPT.replace("{max_wait:g}", f"{s.max_wait_s:g}")},
                    {"role": "user", "content": f"Task:\n{s.instruction}\n\n{_cut(first, s, stats)}"}]
        asked_to_confirm = False
        while True:
            if stats["turns"] >= s.max_turns:
                stats["ended"] = "max_turns"
                break
            if time.monotonic() >= deadline:
                stats["ended"] = "timeout"
                break
            try:
                msg = complete(s.base_url, s.api_key, s.model, messages, s.stream, deadline - time.monotonic())
            except EndpointError as e:
                stats["ended"] = "episode_over" if e.status == 409 else "endpoint_error"
                stats["endpoint_error"] = f"{e.status}: {str(e)[:300]}"
                break
            stats["turns"] += 1
            messages.append(msg)  # exactly as received: the next prompt continues the sampled ids
            try:
                reply = parse_reply(msg.get("content") or "")
            except ReplyError as e:
                stats["parse_errors"][e.reason] = stats["parse_errors"].get(e.reason, 0) + 1
                print(f"turn {stats['turns']}: unusable reply ({e.reason}): {e}", file=out, flush=True)
                messages.append({"role": "user", "content": (
                    f"Your reply could not be used: {e}. Answer with exactly one JSON object with the keys "
                    '"analysis", "plan", "commands" and "task_complete", as the instructions say.')})
                asked_to_confirm = False
                continue
            revived = False
            for c in reply.commands:
                if time.monotonic() >= deadline:
                    break
                revived |= term.revive()
                term.send(c.keystrokes)
                stats["commands"] += 1
                time.sleep(max(0.0, min(c.duration, s.max_wait_s, deadline - time.monotonic())))
            print(f"turn {stats['turns']}: {len(reply.commands)} commands, task_complete={reply.task_complete}",
                  file=out, flush=True)
            if reply.task_complete and asked_to_confirm:
                stats["ended"] = "end_signal"
                break
            if term.revive() or revived:
                stats["shell_restarts"] += 1
                note = "[The terminal's shell exited; a new shell was started.]\n"
            else:
                note = ""
            observation = note + _cut(screen.observe(), s, stats)
            if reply.task_complete:
                asked_to_confirm = True
                stats["task_complete_asked"] += 1
                observation += ("\n\nYou marked the task complete. Once confirmed, your work is graded and you "
                                'cannot change it any more. If it is really done, reply again with "task_complete": '
                                'true; otherwise go on with more commands and "task_complete": false.')
            else:
                asked_to_confirm = False
            messages.append({"role": "user", "content": observation})
    except RuntimeError as e:  # tmux itself failed: the episode ends, its reason kept
        stats["ended"], stats["error"] = "harness_error", str(e)[:300]
    finally:
        term.close()
    return stats


def _cut(text: str, s: Settings, stats: dict) -> str:
    if len(text) > s.max_observation_chars:
        stats["observations_cut"] += 1
    return truncate(text, s.max_observation_chars)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python3 terminus.py --base-url URL --model M [--stream] ... INSTRUCTION`` (the key
    from ``OPENAI_API_KEY``). Exit status 0 when the episode ran to one of its ends, 127 without tmux."""
    p = argparse.ArgumentParser(description="Terminus-style tmux harness for one t1async episode")
    p.add_argument("instruction")
    p.add_argument("--base-url", required=True, help="OpenAI base URL (ends in /v1)")
    p.add_argument("--model", default="t1async")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-turns", type=int, default=50)
    p.add_argument("--time-budget", type=float, default=3600.0, help="seconds")
    p.add_argument("--max-wait", type=float, default=60.0, help="longest wait after one command, seconds")
    p.add_argument("--max-observation-chars", type=int, default=10000)
    p.add_argument("--socket", default="t1async-terminus", help="tmux socket name (-L)")
    a = p.parse_args(argv)
    if shutil.which("tmux") is None:
        print(f"terminus: tmux is not installed in the sandbox; install it with: {TMUX_INSTALL}", flush=True)
        return 127
    stats = run(Settings(a.base_url, os.environ.get("OPENAI_API_KEY", "none"), a.model, a.instruction, a.stream,
                         a.max_turns, a.time_budget, a.max_wait, a.max_observation_chars, a.socket, os.getcwd()))
    print(json.dumps({SUMMARY_KEY: stats}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
