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

A bubblewrap sandbox needs the loopback of the host: ``env.network=on`` (one without network has a
loopback of its own).

In a ``container`` sandbox (:func:`container_plan`) the harness borrows its install from the host, bound
read-only under :data:`BORROWED` (codex: the node binary and its npm package; claude-code: its npm package, a
native executable; mini-swe-agent: its venv and the Python it was made from, at their host paths; terminus:
the host's tmux and the libraries it needs beyond glibc, used only when the image has no tmux), and a shell
prelude makes the command find it. The endpoint's port is served on the container's own loopback
(t1async/envs/sandboxes/loopback_relay.py), so the URL is the same and the task's network stays as it was.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from t1async.rollout import mini_swe_agent, terminus

HOME = "/tmp/t1async-harness"
"""The harness's home inside the sandbox (its configuration and logs; a tmpfs of the sandbox)."""
MODEL = "t1async"
BORROWED = "/opt/t1async-harness"
"""Where a container sandbox sees what a harness borrows of the host (read-only binds; see :func:`container_plan`)."""
GLIBC = ("linux-vdso.so", "ld-linux", "libc.so", "libm.so", "libdl.so", "libpthread.so", "librt.so", "libresolv.so",
         "libutil.so")
"""Libraries a borrowed binary takes from the image (glibc's own: the image's loader must match its libc)."""


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
        first_request_tokens: about how many tokens its first request holds (its system prompt and tool
            declarations, measured on the pinned version: docs/results/2026-12-07-mixed-agents.md); 0: small.
    """

    name: str
    binary: str
    install: str
    dialect: str
    tool: tuple[str, str]
    command: Callable[[str, str, str], str]
    finish: Callable[[str], str | None] | None = None
    turn_check: Callable[[str], str | None] | None = None
    first_request_tokens: int = 0


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
    Harness("codex", "codex", "npm install -g @openai/codex@0.169.0", "responses", ("exec_command", "cmd"), _codex,
            first_request_tokens=9_000),
    Harness("claude-code", "claude", "npm install -g @anthropic-ai/claude-code@2.1", "messages", ("Bash", "command"),
            _claude, first_request_tokens=27_000),
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


@dataclass(frozen=True)
class ContainerPlan:
    """What a harness borrows of the host to run inside a container sandbox.

    Attributes:
        mounts: (host path, path in the container) pairs, bound read-only.
        prelude: shell source run before the harness's command, in the same subshell (a function or a
            ``PATH`` entry that makes its command find the borrowed install); "" when none is needed.
    """

    mounts: tuple[tuple[str, str], ...]
    prelude: str = ""


def _resolved(binary: str, name: str, install: str) -> Path:
    found = shutil.which(binary)
    if found is None:
        raise ValueError(f"rollout.agent={name}: {binary} is not installed; install it with: {install}")
    return Path(found).resolve()


def _npm_plan(h: Harness) -> ContainerPlan:
    """codex, claude-code: the npm package holding the harness's entry (found from the binary's real path),
    plus the node binary when the entry is a node script (codex.js; Claude Code 2.1 is a native executable)."""
    entry = _resolved(h.binary, h.name, h.install)
    package = next((p for p in entry.parents if (p / "package.json").is_file()), None)
    if package is None:
        raise ValueError(f"rollout.agent={h.name}: {entry} is not inside an npm package; reinstall it with: {h.install}")
    inside = f"{BORROWED}/{h.name}"
    mounts = [(str(package), inside)]
    run = f"{inside}/{entry.relative_to(package).as_posix()}"
    with open(entry, "rb") as f:
        script = f.read(2) == b"#!"
    if script:
        node = _resolved("node", h.name, "apt-get install nodejs (or nodesource's node)")
        mounts.append((str(node), f"{BORROWED}/node"))
        run = f"{BORROWED}/node {run}"
    return ContainerPlan(tuple(mounts), f'{h.binary}() {{ {run} "$@"; }}')


def _venv_plan(h: Harness) -> ContainerPlan:
    """mini-swe-agent: its venv and the Python prefix the venv was made from, each at its host path
    (the venv's ``bin/python`` is a symlink to that Python, and ``pyvenv.cfg`` names it)."""
    venv = Path(mini_swe_agent.VENV)
    _resolved(h.binary, h.name, h.install)
    python = (venv / "bin" / "python3").resolve()
    prefix = python.parent.parent
    if prefix in (Path("/usr"), Path("/usr/local"), Path("/")):
        raise ValueError(f"rollout.agent={h.name} in a container: its venv {venv} runs {python}, the system Python, "
                         "which cannot be lent to a container without hiding the image's own /usr; make the venv with a "
                         f"Python outside /usr (tools/setup.sh uses .venv/bin/python): {h.install}")
    return ContainerPlan(((str(venv), str(venv)), (str(prefix), str(prefix))))


def host_libraries(binary: Path) -> tuple[str, list[tuple[str, Path]]]:
    """The dynamic loader ``binary`` names (its path, e.g. ``/lib64/ld-linux-x86-64.so.2``) and (soname, real path)
    of each shared library it loads on the host, glibc's own left out (see :data:`GLIBC`).

    Raises:
        ValueError: ``ldd`` failed on it or named no loader (not a dynamic executable).
    """
    done = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=30)
    loader, out = "", []
    for line in done.stdout.splitlines():
        name, sep, rest = line.strip().partition(" => ")
        if not sep and name.startswith("/"):
            loader = name.split()[0]
        elif sep and not name.startswith(GLIBC) and rest.startswith("/"):
            out.append((name, Path(rest.split()[0]).resolve()))
    if done.returncode != 0 or not loader:
        raise ValueError(f"ldd {binary} failed or named no loader: {(done.stdout + done.stderr).strip()[:200]}")
    return loader, out


NO_PYTHON = ("terminus: the image has no python3 to run the harness with; add to the task's Dockerfile: "
             "RUN apt-get update && apt-get install -y python3")
"""What the terminus prelude says (exit status 127) in a container whose image has no ``python3``."""


def _tmux_plan(h: Harness) -> ContainerPlan:
    """terminus: the image's tmux when it has one; else the host's tmux run by the image's loader with the
    host libraries it needs beyond glibc (libevent, libutempter, libtinfo) as its library path, so nothing
    else in the container sees them. The program itself travels in the command; it runs with the image's
    ``python3``."""
    tmux = _resolved(h.binary, h.name, h.install)
    loader, libs = host_libraries(tmux)
    mounts = [(str(tmux), f"{BORROWED}/tmux/tmux")] + [(str(path), f"{BORROWED}/tmux/lib/{name}") for name, path in libs]
    wrapper = (f'#!/bin/sh\nexec {loader} --library-path {BORROWED}/tmux/lib {BORROWED}/tmux/tmux "$@"\n')
    prelude = (f"command -v python3 >/dev/null 2>&1 || {{ echo {shlex.quote(NO_PYTHON)}; exit 127; }}\n"
               f"if ! command -v tmux >/dev/null 2>&1; then mkdir -p {HOME}/bin && printf {shlex.quote(wrapper)} > "
               f"{HOME}/bin/tmux && chmod +x {HOME}/bin/tmux && export PATH={HOME}/bin:$PATH; fi")
    return ContainerPlan(tuple(mounts), prelude)


@functools.lru_cache(maxsize=None)
def container_plan(name: str) -> ContainerPlan:
    """What the installed harness ``name`` borrows of the host in a container sandbox (cached per process).

    Raises:
        ValueError: one line: the harness is not installed (its install command), or its install cannot be lent
            to a container (why, and what to do).
    """
    h = harness(name)
    plans = {"codex": _npm_plan, "claude-code": _npm_plan, "mini-swe-agent": _venv_plan, "terminus": _tmux_plan}
    return plans[name](h)


def in_container(plan: ContainerPlan, command: str) -> str:
    """``command`` (a harness's shell line) run after ``plan``'s prelude, in a subshell of its own (nothing it
    defines stays in the episode's shell)."""
    return f"(\n{plan.prelude}\n{command}\n)" if plan.prelude else command


def check_sandbox(name: str, sandbox: str) -> None:
    """Refuse, in one line, the harness ``name`` when it is not installed (:func:`harness`: its install command), or
    where it cannot run in the ``sandbox`` backend (``env.sandbox``): in ``container``, an install that cannot be
    lent (:func:`container_plan`) or a process that cannot serve the endpoint inside the container's network
    namespace (not root: t1async/envs/sandboxes/loopback_relay.py needs CAP_SYS_ADMIN and a rootful engine);
    ``modal`` (neither the host's install nor the rollout actor's loopback reaches a Modal sandbox). ``local``
    needs nothing more.

    Raises:
        ValueError: the reason and what to do.
    """
    harness(name)
    if sandbox == "modal":
        raise ValueError(f"rollout.agent={name} cannot run in env.sandbox=modal: the harness's install and the rollout "
                         "actor's endpoint (its loopback) do not reach a Modal sandbox; use env.sandbox=container or local")
    if sandbox == "container":
        container_plan(name)
        if os.geteuid() != 0:
            raise ValueError(f"rollout.agent={name} in env.sandbox=container: entering the container's network namespace "
                             "to serve the endpoint there needs root (CAP_SYS_ADMIN) and a rootful engine; run the "
                             "rollout actors as root, or use env.sandbox=local (bubblewrap) with env.network=on")
