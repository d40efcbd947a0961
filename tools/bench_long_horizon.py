"""``t1async bench long-horizon``: a 300-turn episode through the real sampler, sandbox, trajectory and learner.

Prints ONE JSON object. One process holds every part, each the real one, except the learner's
steps, each run in a fresh child process (an honest peak RSS):

- the sampler: an :class:`~t1async.actors.sampler.EmbeddedSampler` (t1async/sampling/engine.py behind
  its SGLang-shaped HTTP server, prefix cache on, ``sampler.prefix_cache`` default) reached
  through :class:`~t1async.sampling.sampler_client.HttpSampler`, as a rollout actor reaches it, holding
  the learner's initial weights as version 0;
- the episode loop: :func:`t1async.rollout.episode.run_episode` itself, on a shipped task in the
  local (bubblewrap) sandbox, ``--turns`` turns;
- the agent is scripted: each turn's tokens are sampled by the engine (``--max-new-tokens``,
  temperature 1; recorded exactly, TITO), and the shell runs the next command of ``--commands``
  (cycled, ``{i}`` = turn number) in place of the decoded text, so every run does the same shell
  work whatever an untrained policy writes (``env.run_cut_commands`` is on, so a turn cut at the
  token limit still reaches the shell);
- the trajectory: :func:`~t1async.trajectory.encode` / :func:`~t1async.trajectory.decode`;
- the learner: :class:`~t1async.actors.learner.Learner` and its ``_train_step`` on the episode's
  trajectory (batch of one), chunked (``learner.max_tokens_per_chunk``, default) and not, for
  each backend of ``--learner-backends`` (``megatron``: chunked = LM head in chunks and every
  decoder layer recomputed, routing replayed there; needs megatron-core); ``chunked`` says
  whether the step really ran chunked (an episode of at most ``max_tokens_per_chunk`` tokens
  never is, so then both runs are the plain step); with
  ``--learner-tokens N`` also on the trajectory tiled to N tokens (chunked only, and unchunked
  when N <= ``--plain-max-tokens``).

Reports:

- ``sampler``: per-turn latency of ``/generate`` as the rollout sees it (HTTP round trip, ms) and
  of the engine alone, at turns 1, 100 and 300 (the turn itself and the median of the 5 turns
  around it), with the prompt length and the tokens actually prefilled (prompt minus the cached
  prefix); ``ratio_last_over_first`` (windows; target <= 2); ``no_cache_ms`` at the same turns:
  the same request through a second engine on the same weights with the prefix cache off
  (re-prefilling the whole history), side by side; cache hits.
- ``trajectory``: tokens, frame bytes and bytes per token, encode and decode time (median of 5).
- ``routing_memory``: routing rows the rollout holds (wire dtype) and the engine's prefix cache
  holds (int64) for the episode, bytes per token and total; the engine's KV cache likewise.
- ``learner``: per run, tokens, seconds of one step, peak RSS above the process's RSS before the
  step (sampled every 2 ms; MiB and KiB per token), the process's peak RSS, and the step's
  ``logprob_diff_mean`` / ``routing_diff_frac`` (sampler vs learner on the same weights: about 0
  and exactly 0 under replay; on a tiled trajectory, marked ``"trajectory": "tiled..."``, the
  recorded log-probs belong to the original positions, so only the routing difference is a check).

Usage: ``t1async bench long-horizon [--turns 300] [--max-new-tokens 8] [--learner-tokens 0]
[--plain-max-tokens 16384] [--max-context 65536] [--threads 2] [--learner-backends torch]`` (``--max-context`` is the
model's ``max_position_embeddings``: raise it for ``--learner-tokens`` above it). Needs
bubblewrap (``tools/setup.sh`` installs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from loguru import logger

from t1async.actors.learner import Learner
from t1async.actors.rollout import tasks_dir
from t1async.actors.sampler import EmbeddedSampler
from t1async.cli import OneLineErrors, at_least_one, at_least_zero
from t1async.config import (
    EnvConfig,
    GenerationConfig,
    LearnerConfig,
    ModelConfig,
    SamplerConfig,
    TransportConfig,
    WeightSyncConfig,
)
from t1async.envs.taskio.loading import discover_tasks
from t1async.envs.terminal import TerminalEnv
from t1async.learner.backend import BACKENDS
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.episode import run_episode
from t1async.sampling.engine import Engine
from t1async.sampling.sampler_client import HttpSampler
from t1async.trajectory import Trajectory, decode, encode, validate

COMMANDS = "echo turn {i};ls -la /app;pwd;echo {i} >> /app/log.txt;wc -l /app/log.txt;date +%s"
MARK_TURNS = (1, 100, 300)


def rss_bytes() -> int:
    """Resident set size of this process, bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Context manager: the highest RSS seen (every 2 ms, on a thread) while the block runs."""

    def __enter__(self) -> "PeakRss":
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()

        def watch() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, rss_bytes())
                time.sleep(0.002)

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


class ScriptedShell:
    """The env edge of a scripted agent: a real :class:`TerminalEnv` whose ``step`` runs the
    script's next command instead of the policy's decoded text (reset, verify and close pass
    through)."""

    def __init__(self, env: TerminalEnv, commands: list[str]):
        self.env, self.commands, self.turn = env, commands, 0

    def reset(self) -> str:
        return self.env.reset()

    def step(self, command: str):
        self.turn += 1
        return self.env.step(self.commands[(self.turn - 1) % len(self.commands)].format(i=self.turn))

    def verify(self):
        return self.env.verify()

    def close(self) -> None:
        self.env.close()


class TimedSampler:
    """Passes each request to the real HTTP sampler, timing it; at the marked turns, also times
    the same request through ``no_cache`` (an engine on the same weights without a prefix cache)."""

    def __init__(self, inner: HttpSampler, engine: Engine, no_cache: Engine, marks: set[int]):
        self.inner, self.engine, self.no_cache, self.marks = inner, engine, no_cache, marks
        self.turns: list[dict] = []
        self._engine_s = 0.0
        submit = engine.submit

        def timed(*a, **kw):  # the engine alone: the HTTP handler submits, then waits for the result
            t0 = time.perf_counter()
            req = submit(*a, **kw)
            req.result()
            self._engine_s = time.perf_counter() - t0
            return req

        engine.submit = timed  # type: ignore[method-assign]

    def generate(self, input_ids, sampling_params, *, routed_experts_start_len=0):
        cached0 = self.engine.cached_tokens
        t0 = time.perf_counter()
        r = self.inner.generate(input_ids, sampling_params, routed_experts_start_len=routed_experts_start_len)
        row = {"turn": len(self.turns) + 1, "ms": (time.perf_counter() - t0) * 1e3, "engine_ms": self._engine_s * 1e3,
               "prompt_tokens": len(input_ids), "prefilled_tokens": len(input_ids) - (self.engine.cached_tokens - cached0),
               "sampled_tokens": len(r.output_ids)}
        if row["turn"] in self.marks:
            from t1async.sampling.engine import SamplingParams

            t1 = time.perf_counter()
            self.no_cache.generate(list(input_ids), SamplingParams(**sampling_params))
            row["no_cache_ms"] = (time.perf_counter() - t1) * 1e3
        self.turns.append(row)
        return r


def tile(traj: Trajectory, tokens: int) -> Trajectory:
    """``traj``'s stream repeated (its prompt once, then its turns again and again) until it holds
    at least ``tokens`` tokens, cut after a whole turn: a valid trajectory of that length with the
    episode's own mix of sampled and context tokens and its recorded routing rows."""
    start = int(traj.turn_offsets[0][0])
    body = slice(start, traj.num_tokens)
    n_body = traj.num_tokens - start
    reps = max(1, -(-(tokens - start) // n_body))
    cat = lambda a, fill: np.concatenate([a[:start], *([a[body]] * reps)])  # noqa: E731
    # rows: position i's row; the body's last token has no row in traj, so repeat rows of the
    # body's first position (any recorded row is a valid replay) for the seams
    rows = traj.routed_experts
    seam = rows[start:start + 1]
    body_rows = np.concatenate([rows[start:], seam])
    routed = np.concatenate([rows[:start], *([body_rows] * reps)])[:-1]
    offsets = np.concatenate([traj.turn_offsets + k * n_body for k in range(reps)])
    status = np.concatenate([traj.turn_status] * reps)
    return dataclasses.replace(
        traj, token_ids=cat(traj.token_ids, 0), loss_mask=cat(traj.loss_mask, 0), logprobs=cat(traj.logprobs, 0),
        versions=cat(traj.versions, -1), turn_offsets=offsets.astype(np.int32), turn_status=status,
        routed_experts=routed, trajectory_id=f"{traj.trajectory_id}-x{reps}")


def head(traj: Trajectory, turns: int) -> Trajectory:
    """``traj`` cut after its first ``turns`` turns (a valid, shorter trajectory)."""
    end = int(traj.turn_offsets[turns - 1][1])
    return dataclasses.replace(
        traj, token_ids=traj.token_ids[:end], loss_mask=traj.loss_mask[:end], logprobs=traj.logprobs[:end],
        versions=traj.versions[:end], turn_offsets=traj.turn_offsets[:turns], turn_status=traj.turn_status[:turns],
        routed_experts=traj.routed_experts[:end - 1], trajectory_id=f"{traj.trajectory_id}-head")


def learner_child(frame_path: str, chunk: int, threads: int, max_context: int, backend: str = "torch") -> dict:
    """In a fresh process (so that no earlier step's freed memory hides this one's peak): build
    the learner (``learner.backend = backend``) from the bench's seed (the sampler's weights), take
    one warm-up step on the trajectory's first 2 turns (AdamW allocates its state), then time one
    real step on the whole trajectory with ``learner.max_tokens_per_chunk = chunk`` and measure its
    peak RSS."""
    torch.set_num_threads(threads)
    logger.remove()
    model_cfg = dataclasses.replace(ModelConfig(), max_position_embeddings=max_context)
    mc = model_cfg
    frame = Path(frame_path).read_bytes()
    traj = decode(frame, num_experts=mc.num_experts, num_layers=mc.num_hidden_layers, top_k=mc.num_experts_per_tok)
    with tempfile.TemporaryDirectory(prefix="t1async-bench-learner-") as run_dir:
        learner = _learner(model_cfg, run_dir, threads, backend)
        try:
            learner.cfg.max_tokens_per_chunk = chunk
            learner.loop._train_step([head(traj, min(2, len(traj.turn_offsets)))])
            with PeakRss() as mem:
                t0 = time.perf_counter()
                m = learner.loop._train_step([traj])
                dt = time.perf_counter() - t0
        finally:
            learner.close()
    extra = mem.peak - mem.base
    return {"backend": backend, "tokens": traj.num_tokens, "max_tokens_per_chunk": chunk,
            "chunked": bool(m["chunked_micro_batches"]), "step_s": round(dt, 2),
            "peak_rss_added_mib": round(extra / 2**20, 1),
            "peak_rss_added_kib_per_token": round(extra / traj.num_tokens / 1024, 2),
            "process_peak_rss_mib": round(mem.peak / 2**20, 1), "logprob_diff_mean": m["logprob_diff_mean"],
            "routing_diff_frac": m["routing_diff_frac"]}


def learner_step(traj: Trajectory, chunk: int, threads: int, max_context: int, work: Path,
                 backend: str = "torch") -> dict:
    """:func:`learner_child` in a child process (this script with ``--learner-child``); its JSON."""
    path = work / f"traj-{traj.num_tokens}.bin"
    path.write_bytes(encode(traj))
    proc = subprocess.run([sys.executable, __file__, "--learner-child", str(path), "--chunk", str(chunk),
                           "--threads", str(threads), "--max-context", str(max_context), "--backend", backend],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"backend": backend, "tokens": traj.num_tokens, "max_tokens_per_chunk": chunk,
                "error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _learner(model_cfg: ModelConfig, run_dir: str, threads: int, backend: str = "torch") -> Learner:
    """The bench's learner: seed 0, batch of one, ``learner.backend = backend``, default learner
    settings otherwise."""
    return Learner(LearnerConfig(batch_size=1, episodes_per_step=0, backend=backend), model_cfg, TransportConfig(curve=False),
                   WeightSyncConfig(),
                   run_dir, generation=GenerationConfig(), seed=0, torch_threads=threads)


def backends(text: str) -> list[str]:
    """``--learner-backends``: comma-separated learner backends -> list (argparse type)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in BACKENDS for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(BACKENDS)}, comma-separated")
    return names


def at_turn(turns: list[dict], t: int, key: str, window: int = 2) -> dict:
    """The value at turn ``t`` and the median over turns t - window .. t + window (within range)."""
    rows = [r for r in turns if abs(r["turn"] - t) <= window and key in r]
    exact = next((r[key] for r in turns if r["turn"] == t and key in r), None)
    return {"turn": round(exact, 2) if exact is not None else None,
            "window_median": round(statistics.median(r[key] for r in rows), 2) if rows else None}


def main(argv: list[str] | None = None) -> dict:
    p = OneLineErrors(prog="t1async bench long-horizon", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--turns", type=at_least_one, default=300, help="turns of the episode")
    p.add_argument("--max-new-tokens", type=at_least_one, default=8, help="tokens sampled per turn")
    p.add_argument("--commands", default=COMMANDS, help="';'-separated shell commands, cycled ({i}: the turn)")
    p.add_argument("--task", default="create-hello-file", help="shipped task to run in")
    p.add_argument("--max-context", type=at_least_one, default=65536, help="model.max_position_embeddings")
    p.add_argument("--learner-tokens", type=at_least_zero, default=0,
                   help="also train on the episode tiled to at least this many tokens (cut after a whole turn; 0: off)")
    p.add_argument("--plain-max-tokens", type=at_least_zero, default=16384,
                   help="run the unchunked step only up to this length (0: never)")
    p.add_argument("--threads", type=at_least_one, default=2, help="torch intra-op threads")
    p.add_argument("--learner-backends", type=backends, default="torch",
                   help="learner backends whose steps are measured, comma-separated: torch, megatron")
    p.add_argument("--backend", default="torch", help=argparse.SUPPRESS)
    p.add_argument("--learner-child", help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.learner_child:
        out = learner_child(args.learner_child, args.chunk, args.threads, args.max_context, args.backend)
        print(json.dumps(out))
        return out
    torch.set_num_threads(args.threads)
    logger.remove()
    logger.add(lambda m: None, level="ERROR")

    model_cfg = dataclasses.replace(ModelConfig(), max_position_embeddings=args.max_context)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    work = Path(tempfile.mkdtemp(prefix="t1async-bench-long-"))
    learner = _learner(model_cfg, str(work / "run"), args.threads)  # the initial weights, as learner_child's
    sampler = EmbeddedSampler(model_cfg, SamplerConfig(), seed=0, torch_threads=args.threads)
    sampler.load_weights({k: v.detach().clone() for k, v in learner.backend.hf_weights()}, version=0)
    try:
        tok = ChatTokenizer.load()
        task = discover_tasks(tasks_dir(EnvConfig()), [args.task])[0]
        task = dataclasses.replace(task, agent_timeout_s=1e9)
        env_cfg = EnvConfig(max_turns=args.turns, episode_timeout_s=1e9, run_cut_commands=True,
                            end_signal="\x00never\x00")
        env = ScriptedShell(TerminalEnv.from_config(task, work / "episodes", env_cfg),
                            [c.strip() for c in args.commands.split(";") if c.strip()])
        http = HttpSampler(sampler.url(), num_layers=model_cfg.num_hidden_layers, top_k=model_cfg.num_experts_per_tok,
                           num_experts=model_cfg.num_experts)
        no_cache = Engine(sampler.engine.model, seed=1, prefix_cache=0)
        timed = TimedSampler(http, sampler.engine, no_cache, set(MARK_TURNS))
        t0 = time.perf_counter()
        try:
            traj = run_episode(task, env, timed, tok, env_cfg, gen, model_cfg, actor_id=0)
        finally:
            env.close()
        episode_s = time.perf_counter() - t0
        turns = timed.turns
        marks = [t for t in MARK_TURNS if t <= len(turns)]
        first, last = marks[0], marks[-1]
        sampler_out = {
            "turns": len(turns), "finish_reason": traj.finish_reason, "episode_s": round(episode_s, 1),
            **{f"turn_{t}": {"ms": at_turn(turns, t, "ms"), "engine_ms": at_turn(turns, t, "engine_ms"),
                             "no_cache_ms": at_turn(turns, t, "no_cache_ms", 0)["turn"],
                             "prompt_tokens": turns[t - 1]["prompt_tokens"],
                             "prefilled_tokens": turns[t - 1]["prefilled_tokens"]} for t in marks},
            "cache_hits": sampler.engine.cache_hits, "cached_tokens": sampler.engine.cached_tokens,
            "prefilled_tokens_total": int(sum(r["prefilled_tokens"] for r in turns)),
            "prompt_tokens_total": int(sum(r["prompt_tokens"] for r in turns)),
        }
        sampler_out["ratio_last_over_first"] = round(at_turn(turns, last, "ms")["window_median"]
                                                     / at_turn(turns, first, "ms")["window_median"], 3)
        sampler_out["engine_ratio_last_over_first"] = round(at_turn(turns, last, "engine_ms")["window_median"]
                                                            / at_turn(turns, first, "engine_ms")["window_median"], 3)
        sampler_out["meets_target"] = sampler_out["ratio_last_over_first"] <= 2.0

        frame = encode(traj)
        enc, dec = [], []
        mc = model_cfg
        for _ in range(5):
            a = time.perf_counter()
            frame = encode(traj)
            b = time.perf_counter()
            back = decode(frame, num_experts=mc.num_experts, num_layers=mc.num_hidden_layers, top_k=mc.num_experts_per_tok)
            dec.append(time.perf_counter() - b)
            enc.append(b - a)
        assert np.array_equal(back.token_ids, traj.token_ids)
        T = traj.num_tokens
        traj_out = {"tokens": T, "sampled_tokens": int(traj.loss_mask.sum()), "turns": int(len(traj.turn_offsets)),
                    "bytes": len(frame), "bytes_per_token": round(len(frame) / T, 2),
                    "encode_ms": round(statistics.median(enc) * 1e3, 3), "decode_ms": round(statistics.median(dec) * 1e3, 3)}

        entries = list(sampler.engine._cache.values())
        longest = max(entries, key=lambda c: len(c.ids))
        kv_bytes = sum(t.numel() * t.element_size() for t in (*longest.kv._k, *longest.kv._v))
        kv_len = max(t.shape[2] for t in longest.kv._k)
        routing = {"rollout_rows_bytes": int(traj.routed_experts.nbytes),
                   "rollout_bytes_per_token": round(traj.routed_experts.nbytes / max(len(traj.routed_experts), 1), 2),
                   "rollout_dtype": str(traj.routed_experts.dtype),
                   "engine_cache_rows_bytes": int(longest.rows.numel() * longest.rows.element_size()),
                   "engine_cache_rows_bytes_per_token": longest.rows.element_size() * longest.rows[0].numel(),
                   "engine_cache_rows_dtype": str(longest.rows.dtype).removeprefix("torch."),
                   "engine_kv_bytes": kv_bytes, "engine_kv_capacity_tokens": kv_len,
                   "engine_kv_bytes_per_token": round(kv_bytes / kv_len, 1),
                   "cache_entries": len(entries), "cached_sequence_tokens": len(longest.ids)}

        runs = []
        chunk = LearnerConfig().max_tokens_per_chunk
        for t in [traj] + ([tile(traj, args.learner_tokens)] if args.learner_tokens > T else []):
            validate(t, num_experts=mc.num_experts, num_layers=mc.num_hidden_layers, top_k=mc.num_experts_per_tok)
            for backend, c in itertools.product(args.learner_backends, (chunk, 0)):
                if c or t.num_tokens <= args.plain_max_tokens:
                    run = learner_step(t, c, args.threads, args.max_context, work, backend)
                    if t is not traj:  # its repeats sit at new positions after a longer history than when sampled
                        run["trajectory"] = "tiled: logprob_diff_mean compares to log-probs sampled at other positions"
                    runs.append(run)
        out = {"model_parameters": learner.backend.num_parameters(), "threads": args.threads,
               "max_new_tokens": args.max_new_tokens, "sampler": sampler_out, "trajectory": traj_out,
               "routing_memory": routing, "learner": runs}
    finally:
        sampler.shutdown()
        learner.close()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
