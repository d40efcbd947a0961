"""External-agent episodes (``rollout.agent: external``): an agent program drives the episode
through the OpenAI-compatible endpoint; the trajectory is built from the endpoint's records.

Data path of one episode::

    task --reset--> sandbox; session on the actor's endpoint (t1async/rollout/endpoint/)
    agent program started with OPENAI_BASE_URL=<endpoint>/s/<session>/v1, ANTHROPIC_BASE_URL,
        T1ASYNC_SANDBOX_URL, T1ASYNC_INSTRUCTION, T1ASYNC_MAX_TURNS (its own prompts, its own loop)
        /v1/chat/completions, /v1/responses or /v1/messages (streamed or not; t1async/rollout/endpoint/)
            -> prompt ids (previous completion extended, or a new segment after
            a history break) -> sampler /generate -> record (prompt ids, sampled ids, log-probs,
            routed experts, weight version) -> the dialect's answer (tool calls from <tool_call>)
        /sandbox/exec -> the sandbox shell
    ends when the agent exits, calls /done, spends env.max_turns completions, fills the context,
        or the episode's time budget runs out (its process group is killed)
    verifier -> reward (as for the builtin loop)
    records -> one exact trajectory per segment (EpisodeBuilder: sampled ids loss mask 1, the
        ids between two records loss mask 0; drift 0 by construction, checked)

A history break (the agent re-sent a history that does not continue the previous completion) is
never re-tokenized into the stream: with ``rollout.history_break: split`` each exact segment is
sent as its own trajectory (earlier ones with ``finish_reason`` ``history_break``, counted per
learner step in metrics.jsonl ``finish_reasons``; each takes an admission slot of its own,
``Controller.episode_finished``); with ``drop`` the episode raises
:class:`HistoryBreak` (counted by the controller as a failed episode).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from loguru import logger

from t1async.config import EnvConfig, GenerationConfig, ModelConfig, RolloutConfig
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.conversation import template_renders_differently
from t1async.rollout.endpoint.recorder import CompletionRecord
from t1async.rollout.endpoint.server import OpenAIEndpoint
from t1async.rollout.endpoint.session import SessionLimits
from t1async.rollout.env import Env, TaskInfo
from t1async.rollout.episode import EpisodeBuilder, EpisodeError, context_limit
from t1async.rollout.harnesses import HARNESSES, ContainerPlan, Harness, container_plan, harness, in_container
from t1async.sampling.sampler_client import Sampler
from t1async.trajectory import HISTORY_BREAK, TOOL_CALL_CODES, TURN_ABORTED, TURN_LENGTH_CUT, TURN_OK, Trajectory


class HistoryBreak(RuntimeError):
    """The agent broke its history and ``rollout.history_break`` is ``drop``: the episode is not trained."""


def segment_builder(records: list[CompletionRecord], tokenizer: ChatTokenizer,
                    turn_check: Callable[[str], str | None] | None = None) -> EpisodeBuilder:
    """One segment's records as an episode stream: the first prompt, then per record the ids
    between the stream so far and its prompt (loss mask 0) and its sampled ids (loss mask 1).
    ``turn_check`` (a harness whose actions are text: :attr:`Harness.turn_check`) marks a turn the
    endpoint found normal with the tool-call error code of the reason it returns for the turn's text.

    Raises:
        ValueError: a record whose prompt does not extend the stream so far, or routed experts
            that do not continue the rows recorded (the endpoint guarantees both; checked here).
    """
    ep = EpisodeBuilder(records[0].prompt_ids)
    for r in records:
        n = len(ep.ids)
        if r.prompt_ids[:n] != ep.ids:
            raise ValueError(f"record prompt of {len(r.prompt_ids)} ids does not extend the segment's {n} ids")
        if r.routed_experts_start_len != ep.routing_rows:
            raise ValueError(f"record routed experts start at {r.routed_experts_start_len}, "
                             f"the segment has {ep.routing_rows} rows")
        ep.add_context(r.prompt_ids[n:])
        ep.add_sampled(r.output_ids, r.logprobs, r.weight_version, r.routed_experts)
        ep.turn_status[-1] = (TURN_ABORTED if r.finish_reason == "abort" or r.client_disconnected else
                              TURN_LENGTH_CUT if r.finish_reason == "length" else r.status)
        if turn_check is not None and ep.turn_status[-1] == TURN_OK:
            reason = turn_check(tokenizer.decode(r.output_ids).replace("\x00", ""))
            ep.turn_status[-1] = TOOL_CALL_CODES[reason] if reason else TURN_OK
        if isinstance(tokenizer, ChatTokenizer):
            ep.template_mismatches += template_renders_differently(tokenizer, r.output_ids, "tool_call")
        else:  # a model folder's template: counted by the recorder when it rendered the record's prompt
            ep.template_mismatches += r.template_mismatches
    return ep


def agent_environment(base_url: str, session_url: str, instruction: str, max_turns: int, token: str) -> dict[str, str]:
    """The agent program's environment: the actor's own plus the episode's endpoint (OpenAI SDKs read
    ``OPENAI_BASE_URL``/``OPENAI_API_KEY``, Anthropic's ``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY``; the key
    is the session token) and task."""
    env = dict(os.environ)
    env.update(OPENAI_BASE_URL=f"{session_url}/v1", OPENAI_API_KEY=token, ANTHROPIC_BASE_URL=session_url,
               ANTHROPIC_API_KEY=token, T1ASYNC_SANDBOX_URL=f"{session_url}/sandbox",
               T1ASYNC_DONE_URL=f"{session_url}/done", T1ASYNC_INSTRUCTION=instruction,
               T1ASYNC_MAX_TURNS=str(max_turns), T1ASYNC_ENDPOINT=base_url)
    return env


def run_agent_episode(task: TaskInfo, env: Env, sampler: Sampler, tokenizer: ChatTokenizer,
                      endpoint: OpenAIEndpoint, rollout_cfg: RolloutConfig, env_cfg: EnvConfig,
                      gen_cfg: GenerationConfig, model_cfg: ModelConfig, actor_id: int, log_dir: Path,
                      agent: str | None = None) -> list[Trajectory]:
    """Run one episode of ``task`` driven by ``agent`` (``external``: ``rollout_cfg.agent_command``; or a
    named harness; None: ``rollout_cfg.agent``, a single name); return one trajectory per exact segment
    (one unless the agent broke its history and ``history_break`` is split), each with ``agent`` set.

    ``finish_reason``: ``end_signal`` (the agent called /done), ``agent_exit`` (it exited),
    ``max_turns``, ``context_full``, ``timeout`` (the smaller of the task's agent timeout and
    ``env.episode_timeout_s``; the agent's process group is killed).

    Raises:
        EpisodeError: the agent asked for no completion (its exit status and output tail are logged).
        HistoryBreak: a history break under ``history_break: drop``.
        SandboxError: the sandbox could not start.
    """
    started = time.time()
    agent = str(rollout_cfg.agent) if agent is None else agent
    plan = None
    if agent in HARNESSES and getattr(env, "lends_host", False):  # a container: the install and the endpoint lent
        plan = container_plan(agent)
        env.lend_host(plan.mounts, (int(urlsplit(endpoint.url).port or 0),))
    instruction = env.reset()
    budget = min(task.agent_timeout_s, env_cfg.episode_timeout_s)
    params = {"max_new_tokens": gen_cfg.max_new_tokens, "temperature": gen_cfg.temperature, "top_p": gen_cfg.top_p,
              "top_k": gen_cfg.top_k}
    session = endpoint.open(sampler, env.step, SessionLimits(params, env_cfg.max_turns,
                                                             context_limit(env_cfg, model_cfg)))
    session_url = f"{endpoint.url}/s/{session.token}"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"agent-{actor_id}.log"
    if agent in HARNESSES:
        try:
            returncode, finish = _run_harness(harness(agent), env, session, session_url,
                                              instruction, log_path, started + budget, plan)
        finally:
            endpoint.close_session(session)
    else:
        returncode, finish = _run_program(rollout_cfg, endpoint, session, session_url, instruction, env_cfg,
                                          log_path, started + budget)
    with session.lock:  # a request still in flight finishes its record first
        segments = session.recorder.segments()
    tail = log_path.read_bytes()[-2000:].decode(errors="replace")
    logger.info("{} episode of {}: {} completions in {} exact segments ({} history breaks), {} sampler errors, "
                "ended {}, agent exit status {}", agent, task.name, sum(map(len, segments)), len(segments),
                session.recorder.history_breaks, session.sampler_errors, finish, returncode)
    if returncode not in (0, None, -signal.SIGKILL):
        logger.warning("agent of {} exited with status {}; output tail:\n{}", task.name, returncode, tail)
    if not segments:
        raise EpisodeError(f"the agent of {task.name} asked for no completion (exit status {returncode}, "
                           f"{finish}); its output ends: {tail[-300:]!r}")
    if session.recorder.history_breaks and rollout_cfg.history_break == "drop":
        raise HistoryBreak(f"the agent of {task.name} broke its history {session.recorder.history_breaks} times "
                           "(rollout.history_break=drop)")
    verdict = env.verify()
    if verdict.error:
        logger.warning("verifier of {} failed: {}\n--- verifier output (tail) ---\n{}", task.name, verdict.error,
                       verdict.output[-4000:])
    out = []
    turn_check = getattr(HARNESSES.get(agent), "turn_check", None)  # (terminus: unusable replies)
    for k, records in enumerate(segments):
        ep = segment_builder(records, tokenizer, turn_check)
        out.append(ep.finish(
            task=task.name, actor_id=actor_id, num_experts=model_cfg.num_experts, reward=float(verdict.reward),
            passed=verdict.passed, total=verdict.total, resolved=verdict.resolved,
            finish_reason=finish if k == len(segments) - 1 else HISTORY_BREAK,
            tests=[(t.name, t.passed) for t in verdict.tests], verifier_error=verdict.error, agent=agent,
            started_at=started, finished_at=time.time()))
    return out


def _run_program(rollout_cfg: RolloutConfig, endpoint: OpenAIEndpoint, session, session_url: str, instruction: str,
                 env_cfg: EnvConfig, log_path: Path, deadline: float) -> tuple[int | None, str]:
    """``rollout.agent_command`` as a process of the actor's host: (exit status, finish reason)."""
    argv = shlex.split(rollout_cfg.agent_command)
    if argv and argv[0] == "python":  # the actor's own interpreter (the venv's), whatever PATH says
        argv[0] = sys.executable
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, cwd=rollout_cfg.agent_cwd or None, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env=agent_environment(endpoint.url, session_url, instruction, env_cfg.max_turns,
                                                          session.token))
            finish = _wait(proc, session, deadline)
    finally:
        session.end("agent_exit")  # a straggler's later request gets 409, then 404
        endpoint.close_session(session)
    return proc.returncode, finish


def _run_harness(h: Harness, env: Env, session, session_url: str, instruction: str, log_path: Path,
                 deadline: float, plan: ContainerPlan | None = None) -> tuple[int | None, str]:
    """A named harness as one command inside the episode's sandbox (:meth:`Env.run_agent`, killed with
    its processes at the deadline; in a container, after ``plan``'s prelude): (exit status, finish reason:
    ``agent_exit``, ``timeout``, or how the session ended). The session is closed only after the harness
    command returned."""
    result: dict = {}
    command = h.command(session_url, session.token, instruction)

    def run() -> None:
        try:
            result["r"] = env.run_agent(in_container(plan, command) if plan is not None else command,
                                        max(1.0, deadline - time.time()))
        except Exception as e:  # the sandbox failed: the episode ends, its reason kept
            result["error"] = e

    thread = threading.Thread(target=run, name=f"harness-{h.name}", daemon=True)
    thread.start()
    thread.join()
    r = result.get("r")
    output = getattr(r, "output", "") or ""
    log_path.write_text(output or repr(result.get("error")))
    finish = ("timeout" if r is not None and r.timed_out else
              session.ended or (h.finish(output) if h.finish else None) or "agent_exit")
    session.end(finish)
    return (None if r is None else int(r.exit_code)), finish


def _wait(proc: subprocess.Popen, session, deadline: float) -> str:
    """Wait for the agent to exit or the session to end; kill its process group when the
    episode ends first or the deadline passes. Returns the episode's finish reason."""
    while True:
        if proc.poll() is not None:
            return session.ended or "agent_exit"
        if session.done.is_set() or time.time() > deadline:
            reason = session.ended or "timeout"
            session.end(reason)  # later requests get 409
            if reason != "end_signal":
                _kill(proc)
            else:
                try:
                    proc.wait(timeout=5)  # the agent said done: let it exit on its own first
                except subprocess.TimeoutExpired:
                    _kill(proc)
            return reason
        session.done.wait(0.05)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
