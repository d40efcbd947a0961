"""mini-swe-agent as a named harness (``rollout.agent=mini-swe-agent``; registered in t1async/rollout/harnesses.py).

mini-swe-agent (PyPI ``mini-swe-agent`` 2.4, the SWE-agent team's minimal agent) keeps a linear message
history and, in its default config (``mini.yaml``), acts through one ``bash`` tool (``{"command": string}``)
in OpenAI Chat Completions, called through litellm; each command runs in a fresh subshell of the process
that runs ``mini`` (its ``local`` environment), here the episode's sandbox shell, so the commands reach the
task's files. The run ends when a command's output starts with the line
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (the config tells the model to run :data:`SUBMIT` alone), after
``max_consecutive_format_errors`` answers without a valid tool call (``RepeatedFormatError``), or at a limit.

It lives in a virtual environment of its own under ``/usr/local/lib`` (:data:`VENV`, installed by an optional
step of tools/setup.sh): its dependencies (litellm and what it pulls) stay out of t1async's environment, and
``/usr`` is what every ``local`` sandbox sees read-only, beside the Python the venv was made from (the one
running t1async, whose prefixes the sandbox binds). What is set for it, per episode:

- ``-m openai/t1async``: litellm's OpenAI provider, so the request goes to ``model.model_kwargs.api_base``
  (the session's ``/v1``) with ``OPENAI_API_KEY`` (the session token) as its key;
- cost tracking off (``MSWEA_COST_TRACKING=ignore_errors``, ``agent.cost_limit=0``: litellm has no price for
  this model) and litellm's local price table (``LITELLM_LOCAL_MODEL_COST_MAP``: no download at start);
- no first-run setup prompt (``MSWEA_CONFIGURED``), its global config and the saved trajectory under the
  harness's home in the sandbox;
- ``--agent-class default``: the non-interactive agent (no confirmation prompts, no exit prompt).
"""

from __future__ import annotations

import shlex

VENV = "/usr/local/lib/t1async-harness/mini-swe-agent"
"""The virtual environment mini-swe-agent is installed in (visible in the sandbox: /usr is bound)."""
BINARY = f"{VENV}/bin/mini"
VERSION = "2.4.6"
INSTALL = f"python3 -m venv {VENV} && {VENV}/bin/pip install mini-swe-agent=={VERSION}"
"""The one command that installs it (tools/setup.sh runs it with the Python of t1async's own venv)."""
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""The command that ends a mini-swe-agent run (its config's convention), as the model must call it."""
TOOL = ("bash", "command")
"""Its shell tool and that tool's command argument."""


def command(session_url: str, token: str, instruction: str, *, home: str, model: str) -> str:
    """The shell line that runs one mini-swe-agent episode in the sandbox against the session at
    ``session_url`` (its key ``token``) on the task ``instruction``; ``home`` is the harness's home in the
    sandbox, ``model`` the model name the endpoint is asked for (any: the endpoint serves one)."""
    argv = [BINARY, "--agent-class", "default", "-m", f"openai/{model}", "-t", instruction,
            "-c", "mini.yaml", "-c", f"model.model_kwargs.api_base={session_url}/v1",
            "-c", "model.cost_tracking=ignore_errors", "-c", "agent.cost_limit=0",
            "-o", f"{home}/mini-swe-agent.traj.json"]
    env = {"HOME": home, "MSWEA_CONFIGURED": "true", "MSWEA_GLOBAL_CONFIG_DIR": f"{home}/mini-swe-agent",
           "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENAI_API_KEY": token}
    assign = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return f"mkdir -p {home} && {assign} {shlex.join(argv)} < /dev/null"
