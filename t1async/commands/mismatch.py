"""``t1async mismatch CONFIG [key=value ...]``: how far the learner's view of a rollout is from the sampler's.

Runs one set of real episodes (shipped tasks, bubblewrap sandbox, the embedded sampler over HTTP at
``sampler.dtype``, in this process, no Ray) and re-scores every trajectory with the learner-side
model (``mismatch.learner_dtype``) four ways, then prints ONE JSON object to stdout::

    {"none": {...}, "tito": {...}, "r3": {...}, "both": {...}}

=======  ======================================  ==========================================
mode     learner input ids                       routing
=======  ======================================  ==========================================
none     naive: each turn's text decoded and     the learner's routers choose
         re-encoded (:func:`naive_view`)
tito     the exact sampled stream (TITO)         the learner's routers choose
r3       naive                                   recorded rows replayed (mapped by bytes)
both     the exact sampled stream                recorded rows replayed (R3)
=======  ======================================  ==========================================

Per mode (sums over all trajectories; "loss tokens" are the sampler's sampled tokens):

- ``logprob_diff_mean``: mean over loss tokens of |log pi_learner - log mu_sampler|, both of the
  processed distribution the sampler drew from (``generation`` temperature, top-k, top-p; the
  learner scores exactly as the trainer does, :func:`t1async.models.logprobs.token_logprobs`);
- ``kl_k3``: mean over loss tokens of ``(r - 1) - log r``, ``log r = log pi - log mu`` (Schulman
  2020, "Approximating KL divergence"; unbiased for KL(mu || pi) of the processed distributions);
- ``nucleus_boundary_tokens``: learner tokens outside the learner's own top-k/top-p set, kept in
  it anyway (as the trainer does; 0 without truncation);
- ``routing_diff_frac``: fraction of the learner's input positions whose experts differ from the
  sampler's recorded ones in any layer (as sets over top-k), a position whose token the sampler
  never fed (a re-tokenized one) counting as different;
- ``router_diff_frac``: the same with the learner routers' OWN top-k (what no replay would use);
- ``drift_tokens``: loss-region positions whose id differs from the sampled id (position by
  position within each turn, a length difference counting as differing positions);
- ``loss_tokens``, ``positions``: the denominators.

Where naive re-tokenization changes a turn's tokens, the sampler's and the learner's tokens are
aligned on common byte boundaries: a group of tokens between two common boundaries (one token
each side when the ids agree) is compared as a whole, ``d = sum log pi(group) - sum log mu(group)``
(the log-prob of the same bytes along the two token paths), counted once and divided by the
sampler's token count; for single-token groups this is the per-token difference. Under ``r3`` a
re-tokenized position replays the row of the sampled token holding its first byte. The stop token
of a turn is kept as sampled (only text is re-tokenized). A summary (episodes, tokens,
template mismatches, the gap decomposition, seconds) goes to stderr.
"""

from __future__ import annotations

import bisect
import json
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from t1async.actors.rollout import tasks_dir
from t1async.actors.sampler import EmbeddedSampler
from t1async.config import Config, ConfigError, GenerationConfig, check_trainable
from t1async.envs.taskio.loading import discover_tasks
from t1async.envs.terminal import TerminalEnv
from t1async.learner.rl import load_balancing_loss, routing_differs
from t1async.learner.torch_backend import load_policy
from t1async.models.chat_template import ChatTemplateRenderer
from t1async.models.families import load_renderer
from t1async.models.logprobs import token_logprobs
from t1async.models.model import Qwen3MoeForCausalLM
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.episode import run_episode
from t1async.sampling.sampler_client import HttpSampler
from t1async.trajectory import Trajectory

MODES = {"none": (False, False), "tito": (True, False), "r3": (False, True), "both": (True, True)}
"""mode -> (exact TITO ids, replay recorded routing)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------- views of a trajectory


@dataclass
class View:
    """What the learner is fed for one trajectory, and how it lines up with what the sampler did.

    Attributes:
        ids: the learner's token stream [n] (int64); input is ``ids[:-1]``.
        rows: recorded routing to replay at each input position, int64 [n - 1, L, K] (for a
            re-tokenized position: the row of the sampled token holding its first byte).
        aligned: bool [n - 1]: position p holds a token the sampler fed at a known position, so
            ``rows[p]`` is its real recorded routing.
        groups: loss groups ``(learner positions, sum of sampler log-probs, sampler tokens)``.
        drift: loss-region positions whose id differs from the sampled id.
    """

    ids: np.ndarray
    rows: np.ndarray
    aligned: np.ndarray
    groups: list[tuple[list[int], float, int]]
    drift: int


def exact_view(traj: Trajectory) -> View:
    """The TITO view: the trajectory's stream as is, one group per sampled token."""
    mask = traj.loss_mask.astype(bool)
    lp = traj.logprobs
    groups = [([int(t)], float(lp[t]), 1) for t in np.flatnonzero(mask)]
    return View(traj.token_ids.astype(np.int64), traj.routed_experts.astype(np.int64),
                np.ones(traj.num_tokens - 1, dtype=bool), groups, int(traj.drift_tokens))


def token_bytes(tokenizer: ChatTokenizer | ChatTemplateRenderer) -> list[bytes]:
    """The bytes of every id of a byte-level BPE (special and added tokens: their UTF-8 text), for the
    shipped tokenizer or a model folder's (``model.path``; Qwen3, Qwen3.5 and GLM-4.6 are byte-level BPEs).

    Byte-level BPE writes each byte as one printable character (GPT-2's table: the printable
    Latin-1 bytes stand for themselves, the others map to 256 + n in order); this inverts it. A token
    string outside that table (none in those vocabularies) is taken as its UTF-8 text.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char_to_byte = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            char_to_byte[chr(256 + n)] = b
            n += 1
    if isinstance(tokenizer, ChatTemplateRenderer):
        backend, special = tokenizer.tokenizer.backend_tokenizer, set(tokenizer.tokenizer.added_tokens_decoder)
    else:
        backend, special = tokenizer._tok, tokenizer.special_ids
    out = []
    for i in range(tokenizer.vocab_size):
        s = backend.id_to_token(i) or ""
        plain = i in special or any(c not in char_to_byte for c in s)
        out.append(s.encode() if plain else bytes(char_to_byte[c] for c in s))
    return out


def _stop_ids(tokenizer: ChatTokenizer | ChatTemplateRenderer) -> tuple[int, ...]:
    """The ids that end a sampled turn: ``<|im_end|>`` / ``<|endoftext|>``, or the folder's end-of-turn ids."""
    if isinstance(tokenizer, ChatTemplateRenderer):
        return tuple(tokenizer.end_of_turn_ids)
    return tokenizer.im_end_id, tokenizer.eos_id


def _reencode(tokenizer: ChatTokenizer | ChatTemplateRenderer, body: list[int]) -> list[int]:
    """A turn's text decoded and encoded again, as a text-in/text-out pipeline would: the folder's tokenizer
    reads special-token strings as their ids (transformers' own encoding), the shipped one as it encodes."""
    if isinstance(tokenizer, ChatTemplateRenderer):
        text = tokenizer.decode(body)
        return list(tokenizer.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
    return tokenizer.encode(tokenizer.decode(body))


def _byte_groups(a: list[int], b: list[int], tb: list[bytes]) -> list[tuple[int, int, int, int]]:
    """Split token lists ``a`` (sampled) and ``b`` (re-encoded) at their common byte boundaries.

    Returns ``(a0, a1, b0, b1)`` spans covering both lists in order. Boundaries count as common
    only while the bytes before them agree; past the first differing byte, the rest is one group.
    """
    ca, cb = [0], [0]
    for t in a:
        ca.append(ca[-1] + len(tb[t]))
    for t in b:
        cb.append(cb[-1] + len(tb[t]))
    sa, sb = b"".join(tb[t] for t in a), b"".join(tb[t] for t in b)
    c = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
    ia = {off: i for i, off in enumerate(ca)}
    ib = {off: j for j, off in enumerate(cb)}
    cuts = [(ia[o], ib[o]) for o in sorted(set(ca) & set(cb)) if sa == sb or o <= c]
    if cuts[-1] != (len(a), len(b)):
        cuts.append((len(a), len(b)))
    return [(a0, a1, b0, b1) for (a0, b0), (a1, b1) in zip(cuts, cuts[1:])]


def naive_view(traj: Trajectory, tokenizer: ChatTokenizer | ChatTemplateRenderer, tb: list[bytes] | None = None
               ) -> View:
    """The naive view: every turn's text decoded and re-encoded (with ``model.path``, by the folder's
    tokenizer), context ids and stop ids kept.

    The stop id that ended a turn (``<|im_end|>`` or ``<|endoftext|>``, or the folder's end-of-turn
    ids) stays as sampled, so the
    only difference from the stream is the re-tokenized text (see the module docstring for the
    byte alignment).
    """
    tb = tb if tb is not None else token_bytes(tokenizer)
    tok, lp, rec = traj.token_ids.astype(np.int64), traj.logprobs, traj.routed_experts.astype(np.int64)
    stops = _stop_ids(tokenizer)
    ids: list[int] = []
    src: list[int] = []  # stream position whose recorded row each learner position replays
    aligned: list[bool] = []
    groups: list[tuple[list[int], float, int]] = []
    drift, pos = 0, 0
    for s, e in traj.turn_offsets.tolist():
        for t in range(pos, s):  # context: kept one for one
            ids.append(int(tok[t]))
            src.append(t)
            aligned.append(True)
        turn = tok[s:e].tolist()
        stopped = turn[-1] in stops
        body = turn[:-1] if stopped else turn
        re = _reencode(tokenizer, body)
        drift += sum(1 for k in range(max(len(body), len(re)))
                     if k >= len(body) or k >= len(re) or body[k] != re[k])
        base = len(ids)
        ids += re
        starts = np.cumsum([0] + [len(tb[t]) for t in body]).tolist()
        off_b = np.cumsum([0] + [len(tb[t]) for t in re]).tolist()
        for a0, a1, b0, b1 in _byte_groups(body, re, tb):
            same = a1 - a0 == 1 and b1 - b0 == 1 and body[a0] == re[b0]
            for j in range(b0, b1):
                i = a0 if same else min(max(bisect.bisect_right(starts, off_b[j]) - 1, 0), max(len(body) - 1, 0))
                src.append(s + i)
                aligned.append(same)
            groups.append(([base + j for j in range(b0, b1)], float(lp[s + a0:s + a1].sum()), a1 - a0))
        if stopped:
            ids.append(turn[-1])
            src.append(e - 1)
            aligned.append(True)
            groups.append(([len(ids) - 1], float(lp[e - 1]), 1))
        pos = e
    n = len(ids)
    src_arr = np.minimum(np.asarray(src[:n - 1], dtype=np.int64), rec.shape[0] - 1)
    return View(np.asarray(ids, dtype=np.int64), rec[src_arr], np.asarray(aligned[:n - 1], dtype=bool),
                groups, drift)


# ----------------------------------------------------------------------------- scoring


@dataclass
class Tally:
    """Running sums of one mode over trajectories."""

    diff: float = 0.0
    k3: float = 0.0
    loss_tokens: int = 0
    positions: int = 0
    routing_diff: int = 0
    router_diff: int = 0
    drift: int = 0
    boundary: int = 0

    def result(self) -> dict[str, float | int]:
        n, p = max(self.loss_tokens, 1), max(self.positions, 1)
        return {"logprob_diff_mean": self.diff / n, "kl_k3": self.k3 / n, "routing_diff_frac": self.routing_diff / p,
                "drift_tokens": self.drift, "router_diff_frac": self.router_diff / p,
                "nucleus_boundary_tokens": self.boundary, "loss_tokens": self.loss_tokens, "positions": self.positions}


@torch.no_grad()
def score(model: Qwen3MoeForCausalLM, view: View, replay: bool, tally: Tally,
          gen: GenerationConfig | None = None) -> None:
    """Re-score one view with ``model`` (replaying ``view.rows`` when ``replay``) into ``tally``,
    under the sampling processing ``gen`` (temperature > 0, top-k, top-p; None: the plain model)."""
    gen = gen if gen is not None else GenerationConfig()
    inp = torch.from_numpy(view.ids[:-1]).unsqueeze(0)
    rows = torch.from_numpy(view.rows).unsqueeze(0)
    out = model(inp, routed_experts=rows if replay else None, return_routing=True)
    lp, outside = token_logprobs(out.logits, torch.from_numpy(view.ids[1:]).unsqueeze(0), gen.temperature, gen.top_k,
                                 gen.top_p, return_outside=True)
    lp = lp[0].double()
    flat = np.asarray([q - 1 for positions, _, _ in view.groups for q in positions], dtype=np.int64)
    gid = np.repeat(np.arange(len(view.groups)), [len(p) for p, _, _ in view.groups])
    learner_sum = np.bincount(gid, weights=lp.numpy()[flat], minlength=len(view.groups))
    d = learner_sum - np.asarray([mu for _, mu, _ in view.groups], dtype=np.float64)
    tally.diff += float(np.abs(d).sum())
    tally.k3 += float((np.expm1(np.minimum(d, 50.0)) - d).sum())
    tally.loss_tokens += int(sum(n for _, _, n in view.groups))
    tally.boundary += int(outside[0].numpy()[flat].sum())
    not_aligned = ~torch.from_numpy(view.aligned)
    tally.positions += int(inp.shape[1])
    tally.routing_diff += int((routing_differs(out.routed_experts, rows)[0] | not_aligned).sum())
    tally.router_diff += int((routing_differs(out.router_experts, rows)[0] | not_aligned).sum())
    tally.drift += view.drift


# ----------------------------------------------------------------------------- specialisation


def pretraining_corpus(tokenizer: ChatTokenizer, system_prompt: str, tasks: list) -> np.ndarray:
    """Token ids to specialise a policy on: every task rendered as an episode of its oracle
    solution's commands (empty observations), then some Python standard-library sources."""
    ids: list[int] = []
    for task in tasks:
        ids += tokenizer.render_prompt(system_prompt, task.instruction)
        solve = task.path / "solution" / "solve.sh"
        lines = solve.read_text().splitlines() if solve.is_file() else []
        for line in [x.strip() for x in lines if x.strip() and not x.strip().startswith("#")] + ["exit"]:
            ids += [*tokenizer.encode(line), tokenizer.im_end_id]
            if line != "exit":
                ids += tokenizer.render_observation("")
        ids.append(tokenizer.eos_id)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("shlex.py", "textwrap.py", "fnmatch.py", "glob.py", "shutil.py", "tarfile.py", "zipfile/__init__.py",
                 "sqlite3/__init__.py", "argparse.py", "subprocess.py"):
        f = stdlib / name
        if f.is_file():
            ids += [*tokenizer.encode(f.read_text(errors="replace")), tokenizer.eos_id]
    return np.asarray(ids, dtype=np.int64)


def pretrain(model: Qwen3MoeForCausalLM, corpus: np.ndarray, *, steps: int, seq_len: int, batch: int, lr: float,
             aux_coef: float, seed: int) -> dict[str, float]:
    """Next-token training on random windows of ``corpus`` with a load-balancing loss.

    Returns ``{"loss_first", "loss_last", "router_topk_mass"}``: cross-entropy (nats) of the first
    and last 10 steps, and the mean top-k router probability mass afterwards (1/E*K at uniform).
    """
    E, K = model.cfg.num_experts, model.cfg.num_experts_per_tok
    gate_logits: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: gate_logits.append(o)) for layer in model.model.layers]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = np.random.default_rng(seed)
    losses = []
    model.train()
    try:
        for step in range(steps):
            starts = g.integers(0, len(corpus) - seq_len - 1, batch)
            x = torch.from_numpy(np.stack([corpus[s:s + seq_len + 1] for s in starts]))
            gate_logits.clear()
            out = model(x[:, :-1])
            ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1))
            aux = load_balancing_loss(gate_logits, E, K)  # mean over layers
            for grp in opt.param_groups:
                grp["lr"] = lr * min(1.0, (step + 1) / 20)
            opt.zero_grad(set_to_none=True)
            (ce + aux_coef * aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(ce.detach()))
        model.eval()
        with torch.no_grad():
            gate_logits.clear()
            model(torch.from_numpy(corpus[: seq_len * 4].reshape(4, seq_len)))
            mass = float(np.mean([lg.float().softmax(-1).topk(K, -1).values.sum(-1).mean() for lg in gate_logits]))
    finally:
        for h in hooks:
            h.remove()
    return {"loss_first": float(np.mean(losses[:10])) if losses else float("nan"),
            "loss_last": float(np.mean(losses[-10:])) if losses else float("nan"), "router_topk_mass": mass}


# ----------------------------------------------------------------------------- the tool


def rollouts(cfg: Config, policy: Qwen3MoeForCausalLM, episodes: int) -> list[Trajectory]:
    """Run ``episodes`` real episodes against an in-process embedded sampler holding ``policy``'s
    weights (cast to ``cfg.sampler.dtype``), over HTTP, in bubblewrap sandboxes."""
    tasks = discover_tasks(tasks_dir(cfg.env), cfg.env.tasks, sandbox=cfg.env.sandbox)
    sampler = EmbeddedSampler(cfg.model, cfg.sampler, seed=cfg.run.seed, torch_threads=cfg.run.torch_threads)
    tokenizer = load_renderer(cfg.model)  # model.path's own tokenizer and template, or the shipped ChatML
    out = []
    try:
        sampler.load_weights(policy.state_dict(), 0)
        client = HttpSampler(sampler.url(), num_layers=cfg.model.routed_layers, top_k=cfg.model.num_experts_per_tok,
                             timeout_s=cfg.sampler.request_timeout_s)
        with tempfile.TemporaryDirectory(prefix="t1async-mismatch-") as root:
            for i in range(episodes):
                task = tasks[i % len(tasks)]
                env = TerminalEnv.from_config(task, Path(root), cfg.env)
                try:
                    out.append(run_episode(task, env, client, tokenizer, cfg.env, cfg.generation, cfg.model, 0))
                finally:
                    env.close()
    finally:
        sampler.shutdown()
    return out


def build_policy(cfg: Config) -> tuple[Qwen3MoeForCausalLM, dict]:
    """The fp32 policy: loaded, or seeded random init; pretrained if asked (returns its stats)."""
    mc = cfg.mismatch
    torch.manual_seed(cfg.run.seed)
    policy = load_policy(cfg.model, mc.init_checkpoint or None)  # the checkpoint, model.path, or random
    stats: dict = {}
    if mc.pretrain_steps > 0 and cfg.model.path:
        raise ConfigError(f"mismatch.pretrain_steps={mc.pretrain_steps} renders its corpus with the shipped ChatML "
                          f"tokenizer, not model.path={cfg.model.path}'s; set mismatch.pretrain_steps=0")
    if mc.pretrain_steps > 0:
        tokenizer = ChatTokenizer.load()
        corpus = pretraining_corpus(tokenizer, cfg.env.system_prompt, discover_tasks(tasks_dir(cfg.env), []))
        stats = pretrain(policy, corpus, steps=mc.pretrain_steps, seq_len=mc.pretrain_seq_len, batch=mc.pretrain_batch,
                         lr=mc.pretrain_lr, aux_coef=mc.aux_loss_coef, seed=cfg.run.seed)
        stats["corpus_tokens"] = int(corpus.size)
    if mc.save_checkpoint:
        policy.save_pretrained(mc.save_checkpoint)
    return policy.eval(), stats


def evaluate(trajs: list[Trajectory], learner: Qwen3MoeForCausalLM, tokenizer: ChatTokenizer | ChatTemplateRenderer,
             gen: GenerationConfig | None = None) -> dict[str, dict]:
    """Score every trajectory the four ways under the sampling processing ``gen`` (None: the
    plain model); ``{mode: Tally.result()}``."""
    tb = token_bytes(tokenizer)
    tallies = {m: Tally() for m in MODES}
    for traj in trajs:
        views = {True: exact_view(traj), False: naive_view(traj, tokenizer, tb)}
        for mode, (exact, replay) in MODES.items():
            score(learner, views[exact], replay, tallies[mode], gen)
    return {m: t.result() for m, t in tallies.items()}


def measure(cfg: Config) -> dict[str, dict]:
    """The whole tool: policy -> rollouts at the sampler's dtype -> four re-scorings at the
    learner's dtype. Returns the JSON object (summary to stderr).

    Raises:
        ConfigError: ``generation.temperature`` 0 (greedy tokens have no density to compare).
        ValueError: an unknown ``mismatch.learner_dtype`` or a checkpoint of another shape.
    """
    check_trainable(cfg)
    if cfg.mismatch.learner_dtype not in _DTYPES:
        raise ValueError(f"mismatch.learner_dtype {cfg.mismatch.learner_dtype!r} is not one of {sorted(_DTYPES)}")
    torch.set_num_threads(cfg.run.torch_threads)
    t0 = time.perf_counter()
    policy, pre = build_policy(cfg)
    t1 = time.perf_counter()
    trajs = rollouts(cfg, policy, cfg.mismatch.episodes)
    t2 = time.perf_counter()
    learner = policy.to(_DTYPES[cfg.mismatch.learner_dtype]).eval()
    result = evaluate(trajs, learner, load_renderer(cfg.model), cfg.generation)
    t3 = time.perf_counter()
    d = {m: result[m]["logprob_diff_mean"] for m in MODES}
    summary = {
        "sampler_dtype": cfg.sampler.dtype, "learner_dtype": cfg.mismatch.learner_dtype, "episodes": len(trajs),
        "tokens": int(sum(t.num_tokens for t in trajs)), "turns": int(sum(len(t.turn_offsets) for t in trajs)),
        "template_mismatches": int(sum(t.template_mismatches for t in trajs)), "pretrain": pre,
        # additive split of the |dlogp| gap (the modes' differences; the remainder is their interaction)
        "gap_precision": d["both"], "gap_routing": d["tito"] - d["both"], "gap_tokenization": d["r3"] - d["both"],
        "gap_interaction": d["none"] - d["tito"] - d["r3"] + d["both"],
        "seconds": {"policy": round(t1 - t0, 1), "rollouts": round(t2 - t1, 1), "scoring": round(t3 - t2, 1)},
    }
    print(json.dumps({"summary": summary}), file=sys.stderr)
    return result
