"""``t1async sft``: the supervised warm start. Demonstrations from oracle solutions, next-token training.

    t1async sft --tasks DIR --out CKPT_DIR [--config YAML] [--heldout DIR] [key=value ...]

Data path::

    task folder --(oracle solve.sh split into complete commands)--> scripted turns
       --(the rollout's own run_episode, real sandbox, ScriptedSampler in place of the policy)-->
    demonstration = Trajectory (exact ids: prompt, each command + <|im_end|> with loss mask 1,
       each real observation rendered by the chat template with loss mask 0, ``exit``)
       --(resolved by the verifier? else skipped and counted)--> cross-entropy on loss-mask-1
    tokens (+ Switch load-balancing loss) --> checkpoint (config.json + model.safetensors)

A demonstration is produced by exactly the code path a rollout uses
(:func:`t1async.rollout.episode.run_episode`): the same chat template, TITO token stream,
drift repair and observation truncation. Only the sampler differs: :class:`ScriptedSampler`
answers turn k with the k-th oracle command. So what the warm-started policy sees at rollout is
what it saw in training. Demonstrations the policy could not produce at rollout (a command
longer than ``generation.max_new_tokens`` tokens, more commands than ``env.max_turns``) are
skipped and counted, as are oracles whose episode the verifier does not resolve.

The checkpoint is an ordinary Hugging Face folder that ``learner.init_checkpoint``, the
samplers and ``t1async eval --agent policy:CKPT_DIR`` load. With ``--heldout DIR`` the
checkpoint is evaluated on DIR's tasks with that agent at the end. One JSON object is printed:
demonstrations kept and skipped by reason, the loss curve, and the held-out resolved rate.

Source of the load-balancing term: Switch Transformer (Fedus et al. 2021),
``E * sum_e f_e * P_e``.
"""

from __future__ import annotations

import copy
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from loguru import logger

from t1async.commands.evaluate import evaluate, summary
from t1async.commands.synth import oracle_commands
from t1async.config import Config, SftConfig
from t1async.envs.protocol import SandboxError
from t1async.envs.taskio.loading import discover_tasks
from t1async.envs.terminal import TerminalEnv
from t1async.learner.rl import load_balancing_loss
from t1async.learner.torch_backend import load_policy
from t1async.models.chat_template import ChatRenderer, ChatTemplateRenderer
from t1async.models.families import load_renderer, save_model
from t1async.models.model import Qwen3MoeForCausalLM
from t1async.models.tokenizer import check_model_vocab
from t1async.rollout.actions import BASH_TOOL, action_turn_ids
from t1async.rollout.episode import run_episode
from t1async.sampling.sampler_client import SamplerResponse
from t1async.trajectory import Trajectory


class ScriptedSampler:
    """The Sampler protocol, answering turn k with scripted ids (a demonstration's "policy").

    Args:
        turns: ids of each assistant turn, in order (each ends with ``<|im_end|>``).
        num_layers, top_k: the model's MoE shape (routing rows are zeros: nothing is replayed in SFT).

    Raises (from :meth:`generate`):
        IndexError: more turns requested than scripted.
    """

    def __init__(self, turns: Sequence[Sequence[int]], *, num_layers: int, top_k: int):
        self.turns = [list(map(int, t)) for t in turns]
        self.num_layers, self.top_k = num_layers, top_k
        self.calls = 0

    def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any], *,
                 routed_experts_start_len: int = 0) -> SamplerResponse:
        """The next scripted turn, with log-probs 0, weight version 0 and zero routing rows."""
        if self.calls >= len(self.turns):
            raise IndexError(f"the script has {len(self.turns)} turns; turn {self.calls + 1} was requested")
        ids = self.turns[self.calls]
        self.calls += 1
        rows = len(input_ids) + len(ids) - 1 - routed_experts_start_len
        return SamplerResponse(output_ids=list(ids), logprobs=[0.0] * len(ids),
                               routed_experts=np.zeros((rows, self.num_layers, self.top_k), dtype=np.uint8),
                               finish_reason="stop", weight_version=0)


@dataclass
class Demonstrations:
    """Demonstrations built from a task folder.

    Attributes:
        trajectories: one resolved demonstration episode per kept task.
        skipped: task name -> why it was not kept (no oracle, a command too long, too many
            commands, unresolved by its verifier, the sandbox failed).
        stopped_early: names of the kept demonstrations whose demonstrator left the oracle's last
            command out (``sft.early_stop_frac``; oracles of one command are played whole and not
            listed), kept whether resolved or not.
    """

    trajectories: list[Trajectory] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    stopped_early: list[str] = field(default_factory=list)

    def skipped_by_reason(self) -> dict[str, int]:
        """Counts of :attr:`skipped` by the reason's first word group (before ':')."""
        out: dict[str, int] = {}
        for why in self.skipped.values():
            key = why.split(":", 1)[0]
            out[key] = out.get(key, 0) + 1
        return out


def demonstration(task: Any, env: Any, cfg: Config, tokenizer: ChatRenderer, *, stop_early: bool = False) -> Trajectory:
    """Play ``task``'s oracle through :func:`~t1async.rollout.episode.run_episode` and return the episode.

    Each complete command of the oracle solution is one assistant turn (its ids plus
    ``<|im_end|>``), then the end signal. With ``stop_early`` the demonstrator sends the end
    signal in place of the last command (an oracle of one command is played whole). The
    environment is reset by ``run_episode``.

    Raises:
        ValueError: the task has no oracle solution, a command is longer than
            ``generation.max_new_tokens`` tokens, or there are more commands than ``env.max_turns``;
            the message starts with a short reason key.
        SandboxError: the sandbox failed.
    """
    solve = task.solution_path
    if solve is None:
        raise ValueError("no oracle: the task has no runnable solution/solve.sh or solution.sh")
    commands = oracle_commands(solve.read_text())
    if not commands:
        raise ValueError("no oracle: the solution holds no command")
    if stop_early and len(commands) > 1:
        commands = commands[:-1]
    turns = demonstration_turns(tokenizer, cfg.env, task.instruction, commands)
    longest = max(len(t) for t in turns)
    if longest > cfg.generation.max_new_tokens:
        raise ValueError(f"command too long: {longest} tokens > generation.max_new_tokens="
                         f"{cfg.generation.max_new_tokens}")
    if len(commands) > cfg.env.max_turns:
        raise ValueError(f"too many commands: {len(commands)} > env.max_turns={cfg.env.max_turns}")
    mc = cfg.model
    sampler = ScriptedSampler(turns, num_layers=mc.routed_layers, top_k=mc.num_experts_per_tok)
    return run_episode(task, env, sampler, tokenizer, cfg.env, cfg.generation, mc, actor_id=0)


def demonstration_turns(tokenizer: ChatRenderer, env_cfg: Any, instruction: str, commands: list[str]) -> list[list[int]]:
    """The ids of a demonstration's turns (each command, then the end signal), each ending with its end-of-turn
    id: on a model's own template :func:`template_demonstration_turns`, on the shipped ChatML
    :func:`t1async.rollout.actions.action_turn_ids` in ``env.action_format`` (the end signal a plain message)."""
    if isinstance(tokenizer, ChatTemplateRenderer):  # model.path: each turn as the model's own template writes it
        return template_demonstration_turns(tokenizer, env_cfg, instruction, commands)
    turns = [action_turn_ids(tokenizer, c, env_cfg.action_format) for c in commands]
    return [*turns, action_turn_ids(tokenizer, env_cfg.end_signal, "command")]


def template_demonstration_turns(r: ChatTemplateRenderer, env_cfg: Any, instruction: str,
                                 commands: list[str]) -> list[list[int]]:
    """A demonstration's turns on a model's own template: each command as an assistant message (a bash tool
    call with ``env.action_format`` tool_call), then the end signal as plain content, each rendered after the
    episode's opening (system, instruction) by :meth:`ChatTemplateRenderer.render_assistant`. (How a template
    writes an assistant turn does not depend on the earlier turns in the templates t1async knows: Qwen3's adds an
    empty ``<think>`` block to a turn after the last user message whatever precedes it.)"""
    tool = env_cfg.action_format == "tool_call"
    system = env_cfg.tool_system_prompt if tool else env_cfg.system_prompt
    opening = [{"role": "system", "content": system}, {"role": "user", "content": instruction}]
    tools = [BASH_TOOL] if tool else []

    def message(command: str) -> dict:
        if not tool:
            return {"role": "assistant", "content": command}
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": command}}}]}

    return [*(r.render_assistant(opening, message(c), tools) for c in commands),
            r.render_assistant(opening, {"role": "assistant", "content": env_cfg.end_signal}, tools)]


def build_demonstrations(tasks_dir: str | Path, cfg: Config, *, limit: int = 0, concurrency: int = 2) -> Demonstrations:
    """One demonstration per task under ``tasks_dir`` (sorted by name; the first ``limit`` kept
    ones if ``limit`` > 0), each run in its own sandbox, ``concurrency`` at a time.

    ``cfg.sft.early_stop_frac`` of the tasks (a sample seeded by ``cfg.sft.seed``, rounded) are
    played by an imperfect demonstrator that stops one command early (:func:`demonstration`);
    those whose oracle has more than one command lose it, are kept whether their verifier resolves
    them or not, and are listed in ``stopped_early``.

    Raises:
        TaskError: ``tasks_dir`` holds no loadable task.
    """
    tasks = sorted(discover_tasks(tasks_dir, [], sandbox=cfg.env.sandbox), key=lambda t: t.name)
    tokenizer = load_renderer(cfg.model)  # model.path's own template, or the shipped ChatML
    out = Demonstrations()
    names = [t.name for t in tasks]
    early = set(random.Random(cfg.sft.seed).sample(names, round(cfg.sft.early_stop_frac * len(names))))
    with tempfile.TemporaryDirectory(prefix="t1async-sft-") as tmp:
        cut: set[str] = set()  # played by the imperfect demonstrator with a command left out

        def one(task: Any) -> tuple[str, Trajectory | None, str]:
            try:
                with TerminalEnv.from_config(task, Path(tmp), cfg.env) as env:
                    traj = demonstration(task, env, cfg, tokenizer, stop_early=task.name in early)
                if task.name in early and len(oracle_commands(task.solution_path.read_text())) > 1:
                    cut.add(task.name)
            except ValueError as e:
                return task.name, None, str(e)
            except SandboxError as e:
                return task.name, None, f"sandbox failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            if not traj.resolved and task.name not in cut:
                why = traj.verifier_error or f"{traj.passed}/{traj.total} tests passed"
                return task.name, None, f"oracle unresolved: {why}"
            return task.name, traj, ""

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            for name, traj, why in pool.map(one, tasks):
                if traj is None:
                    out.skipped[name] = why
                elif not limit or len(out.trajectories) < limit:
                    out.trajectories.append(traj)
                    if name in cut:
                        out.stopped_early.append(name)
    for name, why in out.skipped.items():
        logger.warning("sft: demonstration of {} skipped: {}", name, why)
    return out


def sft_train(model: Qwen3MoeForCausalLM, demos: list[Trajectory], cfg: SftConfig) -> list[dict[str, float]]:
    """Next-token cross-entropy on the demonstrations' loss-mask-1 tokens (the assistant turns).

    Each step draws ``cfg.batch_size`` demonstrations (seeded), right-pads them (causal attention:
    padding after a sequence never changes its positions' outputs; padded targets are masked) and
    takes one AdamW step on ``CE + aux_loss_coef * load_balancing``, with linear warm-up over
    ``warmup_steps`` then cosine decay to 10 % of ``lr``.

    Returns:
        The loss curve: one ``{"step", "loss", "token_accuracy"}`` per ``cfg.log_every`` steps
        (``loss``: mean CE in nats per assistant token over those steps; ``token_accuracy``:
        fraction of assistant tokens whose argmax is the demonstrated id).

    Raises:
        ValueError: no demonstrations.
    """
    if not demos:
        raise ValueError("no demonstrations to train on")
    E, K = model.cfg.num_experts, model.cfg.num_experts_per_tok
    gate_logits: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: gate_logits.append(o)) for layer in model.model.layers]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    seqs = [(torch.from_numpy(t.token_ids.astype(np.int64)), torch.from_numpy(t.loss_mask.astype(np.float32)))
            for t in demos]
    curve: list[dict[str, float]] = []
    acc_loss, acc_right, acc_tokens = 0.0, 0.0, 0.0
    model.train()
    try:
        for step in range(cfg.steps):
            pick = rng.choice(len(seqs), size=min(cfg.batch_size, len(seqs)), replace=False)
            T = max(int(seqs[i][0].shape[0]) for i in pick)
            ids = torch.zeros(len(pick), T, dtype=torch.int64)
            mask = torch.zeros(len(pick), T)
            for row, i in enumerate(pick):
                n = seqs[i][0].shape[0]
                ids[row, :n], mask[row, :n] = seqs[i]
            gate_logits.clear()
            tgt, keep = ids[:, 1:], mask[:, 1:] > 0
            # the LM head only at the scored positions (the assistant turns): with a real vocabulary (151,936 ids)
            # it is most of a small model's step, and the observation tokens it would score are masked anyway
            hidden = model(ids[:, :-1], logits_to_keep=1).hidden[keep]  # [n, H]
            logits, tgt = model.lm_head(hidden).float(), tgt[keep]  # [n, V], [n]
            n_tok = torch.tensor(float(max(tgt.numel(), 1)))
            ce = F.cross_entropy(logits, tgt, reduction="sum") / n_tok
            # padded positions are routed too; they only shift the balance statistics slightly
            aux = load_balancing_loss(gate_logits, E, K)
            frac = (step + 1) / max(cfg.warmup_steps, 1)
            decay = 0.5 * (1 + np.cos(np.pi * min(1.0, step / max(cfg.steps - 1, 1))))
            for grp in opt.param_groups:
                grp["lr"] = cfg.lr * (frac if step < cfg.warmup_steps else 0.1 + 0.9 * decay)
            opt.zero_grad(set_to_none=True)
            (ce + cfg.aux_loss_coef * aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            with torch.no_grad():
                right = (logits.argmax(-1) == tgt).float().sum()
            acc_loss += float(ce.detach()) * float(n_tok)
            acc_right += float(right)
            acc_tokens += float(n_tok)
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                curve.append({"step": step + 1, "loss": round(acc_loss / acc_tokens, 4),
                              "token_accuracy": round(acc_right / acc_tokens, 4)})
                logger.info("sft step {step}: loss {loss:.4f} token accuracy {token_accuracy:.3f}", **curve[-1])
                acc_loss, acc_right, acc_tokens = 0.0, 0.0, 0.0
    finally:
        for h in hooks:
            h.remove()
        model.eval()
    return curve


def run_sft(cfg: Config, tasks_dir: str | Path, out: str | Path, *, heldout: str | Path | None = None) -> dict[str, Any]:
    """Build demonstrations, train, write the checkpoint to ``out``, evaluate on ``heldout``.

    The policy starts from ``learner.init_checkpoint`` when set, else a seeded random init
    (``run.seed``) of ``model``.

    Returns:
        ``{"checkpoint", "demonstrations", "skipped", "skipped_by_reason", "curve", "seconds",
        "heldout": {resolved_rate, tasks, ...} or absent}``.

    Raises:
        TaskError: no loadable task under ``tasks_dir``. ValueError: no usable demonstration.
    """
    t0 = time.time()
    torch.manual_seed(cfg.run.seed)
    torch.set_num_threads(max(1, cfg.sft.threads))
    demos = build_demonstrations(tasks_dir, cfg, limit=cfg.sft.max_demos, concurrency=cfg.sft.build_concurrency)
    if not demos.trajectories:
        raise ValueError(f"no usable demonstration under {tasks_dir}: {demos.skipped_by_reason()}")
    logger.info("sft: {} demonstrations ({} stopped early, {} skipped: {})", len(demos.trajectories),
                len(demos.stopped_early), len(demos.skipped), demos.skipped_by_reason())
    model = load_policy(cfg.model, cfg.learner.init_checkpoint or None)  # the warm start, model.path, or random
    if cfg.env.action_format == "tool_call" and not cfg.model.path:  # the demonstrations hold the tool tokens' ids
        check_model_vocab(model.cfg.vocab_size, "tool_call",
                          f"{cfg.learner.init_checkpoint}: vocab_size" if cfg.learner.init_checkpoint else "model.vocab_size")
    curve = sft_train(model, demos.trajectories, cfg.sft)
    save_model(out, cfg.model, model)  # HF layout, model.path's config and tokenizer files copied
    result: dict[str, Any] = {
        "checkpoint": str(Path(out).resolve()), "demonstrations": len(demos.trajectories),
        "stopped_early": len(demos.stopped_early),
        "resolved_demonstrations": int(sum(bool(t.resolved) for t in demos.trajectories)),
        "demonstration_tokens": int(sum(t.num_tokens for t in demos.trajectories)),
        "skipped": len(demos.skipped), "skipped_by_reason": demos.skipped_by_reason(), "curve": curve,
    }
    if heldout is not None:
        result["heldout"] = evaluate_policy(out, heldout, cfg)
    result["seconds"] = round(time.time() - t0, 1)
    return result


def evaluate_policy(checkpoint: str | Path, tasks_dir: str | Path, cfg: Config, *, samples: int = 1) -> dict[str, Any]:
    """Resolved rate of ``policy:checkpoint`` on ``tasks_dir`` (``samples`` episodes per task, pass
    k sampling with seed ``run.seed + 1000 k``).

    Uses ``t1async eval``'s own path (:func:`t1async.commands.evaluate.evaluate`), with the config's
    env, generation and sampler sections.

    Returns:
        :func:`t1async.commands.evaluate.summary` over all episodes, plus ``samples`` and
        :func:`breakdown`'s ``pass_at_k`` (the share of tasks at least one of the ``samples``
        episodes resolved: about what sharpening the policy toward its own best samples can reach,
        Chen et al. 2021's pass@k with k = n) and ``per_family``.
    """
    rows = []
    for k in range(samples):
        cfg_k = copy.deepcopy(cfg)
        cfg_k.run.seed = cfg.run.seed + 1000 * k  # each pass draws its own samples
        rows += evaluate(tasks_dir, f"policy:{checkpoint}", concurrency=2, sandbox=cfg.env.sandbox, config=cfg_k)
    return {**summary(rows), "samples": samples, **breakdown(rows)}


def synth_family(task: str) -> str:
    """The family of a task named as ``t1async synth`` names them (``count-matches-1000-0121`` ->
    ``count-matches``: the name less its two trailing ``-seed-index`` parts); other names are their
    own family."""
    parts = task.rsplit("-", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() else task


def breakdown(rows: list[Any]) -> dict[str, Any]:
    """``{"pass_at_k", "per_family"}`` of eval rows (:class:`t1async.commands.evaluate.EvalRow`, several
    per task): the share of tasks with at least one resolved row, and family -> resolved rate of
    its rows, the family being the task name less its two trailing ``-seed-index`` parts (as
    ``t1async synth`` names tasks; other names count as their own family)."""
    by_task: dict[str, list[bool]] = {}
    for r in rows:
        by_task.setdefault(r.task, []).append(bool(r.resolved))
    by_family: dict[str, list[bool]] = {}
    for task, got in by_task.items():
        by_family.setdefault(synth_family(task), []).extend(got)
    return {"pass_at_k": round(sum(any(v) for v in by_task.values()) / len(by_task), 4) if by_task else 0.0,
            "per_family": {f: round(sum(v) / len(v), 4) for f, v in sorted(by_family.items())}}
