"""Named agent harnesses (``rollout.agent``): the CLIs people run, driving an episode from inside its sandbox.

A harness runs as one command in the episode's sandbox shell (:meth:`Env.run_agent`), so the commands
it runs itself reach the task's files; it talks to the rollout actor's agent endpoint
(t1async/rollout/endpoint/) over the loopback, in its own API, with the model name, base URL and key
set for it here. Each is installed by an optional step (tools/setup.sh); a missing one is refused in
one line naming the command that installs it.

- ``codex``: Codex CLI 0.169 (npm ``@openai/codex``), ``codex exec``: OpenAI Responses, streamed. The
  endpoint is declared as a model provider (``-c model_providers.t1async={..., wire_api="responses"}``);
  Codex's own sandbox and approvals are off (the episode's sandbox is the boundary).
- ``claude-code``: Claude Code 2.1 (npm ``@anthropic-ai/claude-code``), ``claude -p``: Anthropic
  Messages, streamed, through ``ANTHROPIC_BASE_URL``; permissions skipped (``IS_SANDBOX=1``: it refuses
  that as root otherwise).
- ``mini-swe-agent``: mini-swe-agent 2.4 (PyPI ``mini-swe-agent``, a venv of its own), ``mini``: OpenAI Chat
  Completions through litellm, one ``bash`` tool; t1async/rollout/mini_swe_agent.py.
- ``terminus``: our Terminus-style tmux harness (t1async/rollout/terminus.py, standard library only),
  shipped into the sandbox as one file and run with its ``python3``: OpenAI Chat Completions; needs
  tmux (``apt-get install tmux``).

The sandbox needs the loopback of the host: ``env.network=on`` (a bubblewrap sandbox without network
has a loopback of its own).
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from t1async.rollout import mini_swe_agent, terminus

HOME = "/tmp/t1async-harness"
"""The harness's home inside the sandbox (its configuration and logs; a tmpfs of the sandbox)."""
MODEL = "t1async"


@dataclass(frozen=True)
class Harness:
    """One named harness.

    Attributes:
        name: the ``rollout.agent`` value.
        binary: the executable it needs: a name on PATH or an absolute path (inside the sandbox as on the host:
            /usr is shared).
        install: the one command that installs it.
        dialect: the API it speaks (``chat``, ``responses``, ``messages``).
        tool: its shell tool and that tool's command argument (what a scripted policy calls; empty: the
            harness has no tool, its actions are text).
        command: (session URL, session token, instruction) -> the shell line that runs one episode.
        finish: the harness's output -> its own finish reason (None: the exit or the session's reason).
        turn_check: a turn's text -> the tool-call error reason it is marked with (None: usable); for a
            harness whose actions are text, not tool calls the endpoint parses.
    """

    name: str
    binary: str
    install: str
    dialect: str
    tool: tuple[str, str]
    command: Callable[[str, str, str], str]
    finish: Callable[[str], str | None] | None = None
    turn_check: Callable[[str], str | None] | None = None


def _codex(session_url: str, token: str, instruction: str) -> str:
    provider = (f'model_providers.{MODEL}={{name="{MODEL}",base_url="{session_url}/v1",wire_api="responses",'
                f'env_key="OPENAI_API_KEY"}}')
    argv = ["codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
            "-c", f"model_provider={MODEL}", "-c", provider, "-m", MODEL, instruction]
    return (f"mkdir -p {HOME}/.codex && HOME={HOME} CODEX_HOME={HOME}/.codex OPENAI_API_KEY={shlex.quote(token)} "
            f"{shlex.join(argv)} < /dev/null")


def _claude(session_url: str, token: str, instruction: str) -> str:
    argv = ["claude", "-p", "--model", MODEL, "--dangerously-skip-permissions", instruction]
    return (f"mkdir -p {HOME} && HOME={HOME} ANTHROPIC_BASE_URL={shlex.quote(session_url)} "
            f"ANTHROPIC_API_KEY={shlex.quote(token)} CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 "
            f"IS_SANDBOX=1 {shlex.join(argv)} < /dev/null")


def _terminus(session_url: str, token: str, instruction: str) -> str:
    path = f"{HOME}/terminus.py"
    argv = ["python3", path, "--base-url", f"{session_url}/v1", "--model", MODEL, "--socket", f"t1async-{token[:16]}",
            instruction]
    return (f"mkdir -p {HOME} && cat > {path} <<'T1ASYNC_TERMINUS_EOF'\n{Path(terminus.__file__).read_text()}"
            f"T1ASYNC_TERMINUS_EOF\nOPENAI_API_KEY={shlex.quote(token)} {shlex.join(argv)} < /dev/null")


def _terminus_finish(output: str) -> str | None:
    ended = (terminus.outcome(output) or {}).get("ended")
    return ended if ended in ("end_signal", "max_turns", "timeout") else None


HARNESSES: dict[str, Harness] = {h.name: h for h in (
    Harness("codex", "codex", "npm install -g @openai/codex@0.169.0", "responses", ("exec_command", "cmd"), _codex),
    Harness("claude-code", "claude", "npm install -g @anthropic-ai/claude-code@2.1", "messages", ("Bash", "command"),
            _claude),
    Harness("mini-swe-agent", mini_swe_agent.BINARY, mini_swe_agent.INSTALL, "chat", mini_swe_agent.TOOL,
            partial(mini_swe_agent.command, home=HOME, model=MODEL)),
    Harness("terminus", "tmux", terminus.TMUX_INSTALL, "chat", ("", ""), _terminus, _terminus_finish, terminus.turn_problem),
)}
"""Every named harness by ``rollout.agent`` value."""


def harness(name: str) -> Harness:
    """The installed harness ``name``.

    Raises:
        ValueError: one line: an unknown name (listing them), or the harness not installed (naming the
            command that installs it).
    """
    if name not in HARNESSES:
        raise ValueError(f"rollout.agent={name!r} is not a harness; the harnesses are {', '.join(HARNESSES)} "
                         "(or builtin, external)")
    h = HARNESSES[name]
    if shutil.which(h.binary) is None:
        raise ValueError(f"rollout.agent={name}: {h.binary} is not installed; install it with: {h.install}")
    return h
