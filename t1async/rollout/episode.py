"""One episode: run a multi-turn terminal episode against a sampler and build its trajectory.

Data path of one episode (TITO: token in, token out; docs/architecture.md, "The data path"):

    task --reset--> sandbox with /app; prompt ids = chat template(system, instruction)
    loop over turns:
        ids --/generate--> sampled ids, log-probs, routed experts (rows from the first
                           position not yet recorded), weight version
        append the sampled ids exactly (loss mask 1); if the turn did not end with the
        end-of-turn id, append it with loss mask 0 (drift repair)
        decoded text == end signal -> stop; else run it in the sandbox shell and append the
        observation, rendered on its own (loss mask 0)
    verifier -> per-test results, reward = tests passed
    trim the stream after the last sampled token (the Ray role, t1async/actors/rollout.py, encodes it and
    hands it to the sender, which spools, sends and resends until the learner acknowledges; see
    t1async/transport/transport.py)

Nothing already in the stream is ever re-tokenized. Turn boundaries, case by case (tested in
tests/unit/rollout/test_tito.py):

- ended with ``<|im_end|>`` (sampled, loss mask 1): nothing to repair;
- ended on ``<|endoftext|>`` (also a stop id): the eos stays in the stream as sampled (mask 1),
  the command is the text before it, ``<|im_end|>`` is appended with mask 0;
- length limit / the model ran on without a stop id: ``<|im_end|>`` appended with mask 0;
- empty command (only whitespace before the stop): not run; the observation is empty;
- cut at ``max_new_tokens`` (finish_reason ``length``): the command is not run unless
  ``env.run_cut_commands``; the observation says so (:data:`CUT_NOTE`);
- aborted by the sampler (finish_reason ``abort``, SGLang only): the command is not run, the
  observation says so (:data:`ABORT_NOTE`), the episode goes on;
- unparseable text (special-token ids sampled mid-turn, bytes that are not UTF-8): the command is
  the decoded text as is; the ids stay exactly as sampled;
- ``env.action_format`` tool_call (t1async/rollout/actions.py): the command is the ``bash`` call's
  argument; a malformed call is not run, its observation is the error message and its status a
  tool-call error code (a cut turn stays length-cut); observations are ``<tool_response>`` user
  turns. The ids are kept and repaired exactly as above.

Two per-trajectory counters travel with the trajectory: ``drift_tokens`` (loss-mask-1 positions
whose id differs from the id the sampler returned; 0 by construction, checked at ``finish``) and
``template_mismatches`` (turns where rendering the history through the chat template,
``render_turn("assistant", text)``, gives other ids than the stream holds for that turn: BPE merges
across the header or inside the decoded text, a sampled eos or special token, invalid UTF-8; the
stream wins, the count is a metric). Each turn's abnormal end (cut, aborted, command timed out,
refused by a sandbox limit) is recorded in ``turn_status`` (codes in t1async/trajectory.py); the
learner decides what to train of it (``learner.abnormal``). The rollout actor waits for admission from
the controller before each episode (staleness control) and stops when admission says so. With
``rollout.agent: external`` an agent program drives the episode instead, through this actor's
OpenAI-compatible endpoint, and the trajectory is built from its records (t1async/rollout/endpoint/agent.py).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from loguru import logger

from t1async.config import EnvConfig, GenerationConfig, ModelConfig
from t1async.models.chat_template import ChatRenderer
from t1async.rollout.conversation import start_conversation
from t1async.rollout.env import Env, TaskInfo
from t1async.sampling.sampler_client import Sampler, SamplerError
from t1async.trajectory import (
    TOOL_CALL_CODES,
    TURN_ABORTED,
    TURN_COMMAND_TIMEOUT,
    TURN_CUT_NOT_RUN,
    TURN_LENGTH_CUT,
    TURN_SANDBOX_REFUSED,
    Trajectory,
)

CUT_NOTE = "[your message was cut at the limit of {n} tokens; the command was not run]"
"""Observation of a turn cut at ``max_new_tokens`` whose command was not run (``{n}``: the limit)."""
ABORT_NOTE = "[the sampler aborted your message; the command was not run]"
"""Observation of a turn the sampler aborted."""


class EpisodeError(RuntimeError):
    """An episode ended before it sampled anything (its prompt does not fit the context, or its
    time budget was spent first): there is no trajectory to send."""


class EpisodeBuilder:
    """Accumulates one episode's token stream; every list stays aligned token by token.

    Routing rows: request k returns rows from ``routing_rows`` (the first position not yet
    recorded) to the end of what it fed, so the concatenated rows cover positions
    0 .. len(stream) - 2 exactly once, in order; the last sampled token has no row.
    """

    def __init__(self, prompt_ids: list[int]):
        self.ids: list[int] = list(prompt_ids)
        self.mask: list[int] = [0] * len(prompt_ids)
        self.logprobs: list[float] = [0.0] * len(prompt_ids)
        self.versions: list[int] = [-1] * len(prompt_ids)
        self.turns: list[tuple[int, int]] = []
        self.turn_status: list[int] = []  # one code per turn (t1async.trajectory.TURN_STATUS)
        self.sampled: list[list[int]] = []  # what the sampler returned, per turn, kept apart to measure drift
        self.routing: list[np.ndarray] = []
        self.routing_rows = 0
        self.template_mismatches = 0

    def add_sampled(self, ids: list[int], logprobs: list[float], version: int, routing: np.ndarray) -> None:
        """Append one turn's sampled ids (loss mask 1) and the routing rows of this request.

        Raises:
            ValueError: ``logprobs`` not aligned with ``ids``, or ``routing`` rows that do not
                cover exactly the positions fed since the last request (a stale or shifted row).
        """
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(logprobs)} log-probs for {len(ids)} sampled ids")
        fed = len(self.ids) + len(ids) - 1 - self.routing_rows
        if routing.shape[0] != fed:
            raise ValueError(f"sampler returned {routing.shape[0]} routing rows, expected {fed} (positions "
                             f"{self.routing_rows} .. {len(self.ids) + len(ids) - 2})")
        self.sampled.append([int(i) for i in ids])
        start = len(self.ids)
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += [version] * len(ids)
        self.turns.append((start, len(self.ids)))
        self.turn_status.append(0)  # set by the caller once the turn's command has run
        self.routing.append(routing)
        self.routing_rows += routing.shape[0]

    def add_context(self, ids: list[int]) -> None:
        """Append ids the policy did not sample (repair, observation): loss mask 0."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def drift_tokens(self) -> int:
        """Loss-region positions whose id differs from the id the sampler returned (0 under TITO)."""
        return sum(int(np.count_nonzero(np.asarray(self.ids[s:e]) != np.asarray(sampled)))
                   for (s, e), sampled in zip(self.turns, self.sampled))

    def finish(self, **kw: Any) -> Trajectory:
        """The trajectory, trimmed to end at the last sampled token (later ids were never fed back)."""
        end = self.turns[-1][1]
        routing = np.concatenate(self.routing, axis=0)
        if routing.shape[0] != end - 1:
            raise RuntimeError(f"routed experts cover {routing.shape[0]} positions, the stream has {end - 1} fed back")
        drift = self.drift_tokens()
        if drift:
            logger.error("TITO drift: {} loss-region tokens differ from the sampled ids", drift)
        return Trajectory(
            token_ids=np.asarray(self.ids[:end], dtype=np.uint32),
            loss_mask=np.asarray(self.mask[:end], dtype=np.uint8),
            logprobs=np.asarray(self.logprobs[:end], dtype=np.float32),
            versions=np.asarray(self.versions[:end], dtype=np.int32),
            turn_offsets=np.asarray(self.turns, dtype=np.int32),
            turn_status=np.asarray(self.turn_status, dtype=np.uint8),
            routed_experts=routing,
            drift_tokens=drift,
            template_mismatches=self.template_mismatches,
            **kw,
        )


def run_episode(task: TaskInfo, env: Env, sampler: Sampler, tokenizer: ChatRenderer, env_cfg: EnvConfig,
                gen_cfg: GenerationConfig, model_cfg: ModelConfig, actor_id: int) -> Trajectory:
    """Run one episode of ``task`` to its end and return its trajectory (the env is reset here, closed by the caller).

    The episode ends on the end signal, after ``env_cfg.max_turns`` turns, when the agent's time
    budget (the smaller of the task's and ``env_cfg.episode_timeout_s``) is spent, or when the
    next turn would not fit the context (:func:`context_limit`; ``finish_reason`` ``context_full``).

    Each turn's status is recorded (``turn_status``): a turn cut at ``max_new_tokens`` is never
    run as if it were whole (not run unless ``env_cfg.run_cut_commands``; marked length-cut
    either way), an aborted turn is not run, and a command that timed out or hit a sandbox limit
    is marked so. A cut or aborted turn is never taken as the end signal.

    Raises:
        SamplerError, SandboxError: the episode could not run (the caller logs and counts it),
            including a sampler answer without a single token.
        EpisodeError: the episode ended before its first turn (no trajectory).
    """
    started = time.time()
    instruction = env.reset()
    budget = min(task.agent_timeout_s, env_cfg.episode_timeout_s)
    conv = start_conversation(tokenizer, env_cfg, instruction)
    ep = EpisodeBuilder(conv.prompt)
    params = {"max_new_tokens": gen_cfg.max_new_tokens, "temperature": gen_cfg.temperature, "top_p": gen_cfg.top_p,
              "top_k": gen_cfg.top_k, "stop_token_ids": list(conv.stop_ids)}
    context = context_limit(env_cfg, model_cfg)
    finish = "max_turns"
    for _ in range(env_cfg.max_turns):
        if time.time() - started > budget:
            finish = "timeout"
            break
        if len(ep.ids) + gen_cfg.max_new_tokens > context:
            finish = "context_full"
            break
        resp = sampler.generate(ep.ids, params, routed_experts_start_len=ep.routing_rows)
        if not resp.output_ids:  # an empty turn has no span to train or mark (e.g. an abort before any token)
            raise SamplerError(f"sampler answered no tokens (finish_reason {resp.finish_reason!r}) "
                               f"after {len(ep.turns)} turns")
        ep.add_sampled(resp.output_ids, resp.logprobs, resp.weight_version, resp.routed_experts)
        ended = resp.output_ids[-1] == conv.repair_ids[0]  # a turn that ends otherwise is closed (drift repair)
        action = conv.assistant_turn(resp.output_ids)
        command = action.command
        cut, aborted = resp.finish_reason == "length", resp.finish_reason == "abort"
        run_it = not aborted and (not cut or env_cfg.run_cut_commands)
        if run_it and action.end:
            finish = "end_signal"
            break
        if not ended:
            ep.add_context(conv.repair_ids)  # drift repair: close the turn as the template would
        output = ""
        if aborted:
            ep.turn_status[-1], output = TURN_ABORTED, ABORT_NOTE
        elif cut and not run_it:
            ep.turn_status[-1], output = TURN_CUT_NOT_RUN, CUT_NOTE.format(n=gen_cfg.max_new_tokens)
        elif action.error is not None:  # a malformed tool call: not run, the agent is told why
            ep.turn_status[-1] = TURN_CUT_NOT_RUN if cut else TOOL_CALL_CODES[action.error]
            output = action.message
        elif command:
            result = env.step(command)
            output = result.output
            if cut:
                ep.turn_status[-1] = TURN_LENGTH_CUT
            elif result.refused:
                ep.turn_status[-1] = TURN_SANDBOX_REFUSED
            elif result.timed_out:
                ep.turn_status[-1] = TURN_COMMAND_TIMEOUT
        elif cut:
            ep.turn_status[-1] = TURN_LENGTH_CUT
        ep.add_context(conv.observation(output, ep.ids))
    ep.template_mismatches = conv.template_mismatches
    if not ep.turns:  # nothing sampled: no trajectory to build (the caller counts the failed episode)
        raise EpisodeError(f"episode of {task.name} ended ({finish}) before its first turn: the prompt is "
                           f"{len(ep.ids)} tokens, the context {context} and generation.max_new_tokens "
                           f"{gen_cfg.max_new_tokens}" + ("; raise env.max_context_tokens or "
                           "model.max_position_embeddings, or shorten the prompt" if finish == "context_full" else ""))
    verdict = env.verify()
    if verdict.error:  # keep the evidence: the trajectory carries only the error line
        logger.warning("verifier of {} failed: {}\n--- verifier output (tail) ---\n{}", task.name, verdict.error,
                       verdict.output[-4000:])
    return ep.finish(
        task=task.name, actor_id=actor_id, num_experts=model_cfg.num_experts, reward=float(verdict.reward),
        passed=verdict.passed, total=verdict.total, resolved=verdict.resolved, finish_reason=finish,
        tests=[(t.name, t.passed) for t in verdict.tests], verifier_error=verdict.error,
        started_at=started, finished_at=time.time(),
    )


def context_limit(env_cfg: EnvConfig, model_cfg: ModelConfig) -> int:
    """Most tokens an episode's stream may reach: ``env.max_context_tokens`` capped at the model's
    ``max_position_embeddings`` (0: the model's). A turn starts only while the stream plus
    ``generation.max_new_tokens`` fits, so no prompt the sampler is sent is ever too long."""
    model_max = model_cfg.max_position_embeddings
    return min(env_cfg.max_context_tokens, model_max) if env_cfg.max_context_tokens else model_max
