"""The ``torch`` learner backend: t1async/models/model.py's plain-PyTorch Qwen3-MoE as policy, critic
and reference (the CPU default; the interface is t1async/learner/backend.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

from t1async.config import GenerationConfig, LearnerConfig, ModelConfig
from t1async.config.model_folder import resolve_model
from t1async.learner.backend import AdamWPair, PolicyForward, chunk_size
from t1async.models.families import build_model, checkpoint_rounds, family, load_model, save_model
from t1async.models.logprobs import EMBEDDED, SamplingSemantics, token_logprobs
from t1async.models.model import Qwen3MoeForCausalLM, Qwen3MoeModel
from t1async.weights.buckets import pack_parameters

__all__ = ["TorchBackend", "ValueModel", "chunked_token_logprobs", "layer_checkpointing", "load_critic", "load_policy"]


class ValueModel(nn.Module):
    """Critic: a Qwen3-MoE trunk (warm-started from the policy's weights) with a scalar head.

    ``forward(input_ids [B, T]) -> values [B, T]`` float32: the value of the state after
    reading ``input_ids[:, :t+1]``, i.e. before the token at position t + 1 is sampled.
    The critic routes with its own router (it has its own weights; replaying the policy's
    routing would be meaningless for it). The head is a float32 ``nn.Linear(hidden, 1)`` with a
    bias, zero-initialised, on the float32 upcast of the final-norm hidden states.
    """

    def __init__(self, policy: Qwen3MoeForCausalLM):
        super().__init__()
        self.backbone = copy.deepcopy(policy.model)  # the trunk only: no LM head (vocab x hidden) to store or run
        self.head = nn.Linear(policy.cfg.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        hidden, _, _ = self.backbone(input_ids, positions, None, None)
        return self.head(hidden.float()).squeeze(-1)


@contextmanager
def layer_checkpointing(trunk: Qwen3MoeModel) -> Iterator[None]:
    """Turn on ``trunk.gradient_checkpointing`` for the forwards inside the block (the backward
    may run later: the checkpoints recorded in the block recompute their layer then)."""
    before = trunk.gradient_checkpointing
    trunk.gradient_checkpointing = True
    try:
        yield
    finally:
        trunk.gradient_checkpointing = before


def chunked_token_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tgt: torch.Tensor,
                           g: GenerationConfig, chunk: int, semantics: SamplingSemantics = EMBEDDED
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`t1async.models.logprobs.token_logprobs` of ``head(hidden).float()``, ``chunk`` positions at a time.

    With gradients on, each chunk is checkpointed (``torch.utils.checkpoint``, non-reentrant):
    only its hidden slice is kept and its logits are recomputed, one chunk at a time, in the
    backward, so at most ``chunk x vocab_size`` logits live at once. Every position's log-prob
    is a function of its own row alone (log-softmax, top-k, top-p are per row), so chunking
    changes nothing but the matmul's summation blocking.

    Args:
        head: the LM head ([..., H] -> [..., V]; a module or any function of the hidden states).
        hidden: float [B, T, H] final-norm hidden states.
        tgt: int64 [B, T] target ids.
        g: temperature, top-k, top-p the samplers used.
        chunk: positions per chunk, >= 1.
        semantics: the samplers' log-prob semantics (t1async/models/logprobs.py :class:`SamplingSemantics`).

    Returns:
        (float32 [B, T] log-probs, bool [B, T] targets kept outside the filter's set).
    """
    def score(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(head(h).float(), t, g.temperature, g.top_k, g.top_p, semantics=semantics,
                              return_outside=True)

    parts = []
    for s in range(0, hidden.shape[1], chunk):
        h, t = hidden[:, s:s + chunk], tgt[:, s:s + chunk]
        parts.append(checkpoint(score, h, t, use_reentrant=False) if torch.is_grad_enabled() else score(h, t))
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def scored_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tgt: torch.Tensor,
                    g: GenerationConfig, chunk: int, semantics: SamplingSemantics = EMBEDDED,
                    score: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the targets at the positions of ``score`` only, in chunks of ``chunk`` positions
    (:func:`chunked_token_logprobs`; 0: in one pass).

    The LM head and the log-softmax run on the scored rows alone (the sampled tokens; observation and prompt
    tokens are never scored by a loss): with a real vocabulary (151,936 ids) the head is most of a small model's
    step, and the ``[B, T, V]`` logits are never formed. Each row's log-prob is a function of its own row, so the
    scored values equal those of a full pass but for the matmul's summation blocking.

    Args:
        hidden: float [B, T, H]; tgt: int64 [B, T]; score: bool [B, T] or None (every position).

    Returns:
        (float32 [B, T] log-probs, 0 where not scored; bool [B, T] outside flags, False where not scored).
    """
    def run(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if chunk:
            return chunked_token_logprobs(head, h, t, g, chunk, semantics)
        return token_logprobs(head(h).float(), t, g.temperature, g.top_k, g.top_p, semantics=semantics,
                              return_outside=True)

    if score is None:
        return run(hidden, tgt)
    lp, out = run(hidden[score][None], tgt[score][None])  # the scored rows: [1, n, H], [1, n]
    zeros = torch.zeros(tgt.shape, dtype=lp.dtype, device=lp.device)
    return zeros.masked_scatter(score, lp[0]), torch.zeros_like(score).masked_scatter(score, out[0])


def load_policy(model_cfg: ModelConfig, init: str | Path | None) -> nn.Module:
    """The policy of ``model_cfg``'s family (t1async/models/families.py): from checkpoint folder ``init``,
    else from ``model.path``, else a fresh seeded one (the caller seeds torch). Weights are streamed.

    Raises:
        ValueError: the checkpoint's config.json describes another architecture than ``model_cfg``.
        ModelFolderError: the folder's weights do not match (named), or its family is not implemented.
    """
    if not init:
        return load_model(model_cfg) if model_cfg.path else build_model(model_cfg)
    theirs = resolve_model(ModelConfig(path=str(init))).architecture()
    ours = model_cfg.architecture()
    if theirs != ours:
        diff = ", ".join(f"{k} {theirs[k]!r} (model: {ours[k]!r})" for k in ours if theirs[k] != ours[k])
        raise ValueError(f"checkpoint {init} has another architecture than `model`: {diff}")
    return load_model(model_cfg, init)


def load_critic(policy: nn.Module, cfg: LearnerConfig) -> "ValueModel":
    """The critic: the policy's trunk with a fresh zero value head (the warm start of PPO's critic from the
    policy), or, with ``learner.critic_path``, the trunk and head of that checkpoint's ``critic.safetensors``.

    Raises:
        ValueError: ``critic_path`` holds no critic.safetensors, or one of another shape (names listed).
    """
    critic = ValueModel(policy)
    if cfg.critic_path:
        path = Path(cfg.critic_path) / "critic.safetensors"
        if not path.is_file():
            raise ValueError(f"learner.critic_path={cfg.critic_path} holds no critic.safetensors; give a checkpoint "
                             "folder of a run with a critic (RUN_DIR/checkpoints/step_N)")
        missing, unexpected = critic.load_state_dict(load_file(str(path)), strict=False)
        if missing or unexpected:
            raise ValueError(f"{path} does not fit this policy's critic: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}; it must come from a run of the same model")
    return critic


class TorchBackend(AdamWPair):
    """Policy, critic (:class:`ValueModel`) and, with ``cfg.kl_coef`` > 0, a frozen reference (the
    warm start ``cfg.init_checkpoint``, else a copy of the initial policy), all float32 on CPU by
    default; AdamW for each (t1async/learner/backend.py).

    Args:
        cfg, model_cfg: learner settings and policy architecture.
        generation: the samplers' temperature, top-k and top-p (log-probs are of that distribution).
        semantics: which distribution the samplers' log-probs are of (renormalised or not:
            t1async/models/logprobs.py :class:`SamplingSemantics`, from ``sampler.backend``).
        init: checkpoint folder of the policy, or None (seeded init).
        device, dtype: where and in which dtype the models run (the critic's head stays float32).
    """

    name = "torch"

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, generation: GenerationConfig,
                 init: str | Path | None = None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, semantics: SamplingSemantics = EMBEDDED):
        self.cfg, self.generation, self.semantics = cfg, generation, semantics
        self.device = torch.device(device)
        self.model_cfg = model_cfg
        family(model_cfg, self.name)
        self.policy = load_policy(model_cfg, init)
        self.critic = load_critic(self.policy, cfg) if cfg.critic else None  # learner.critic: false builds none
        self.reference: nn.Module | None = None
        if cfg.kl_coef > 0:
            self.reference = (load_policy(model_cfg, cfg.init_checkpoint) if cfg.init_checkpoint
                              else copy.deepcopy(self.policy)).eval().requires_grad_(False)
        if self.device.type != "cpu" or dtype != torch.float32:
            for m in (self.policy, self.critic, self.reference):
                if m is not None:
                    m.to(self.device, dtype)
            if self.critic is not None:
                self.critic.head.float()
        pack_parameters(self.policy)  # each publish bucket is a view of the policy: no concatenation
        self._init_optimizers()

    def _chunk(self, inp: torch.Tensor) -> int:
        """Tokens per chunk for a sequence of ``inp.shape[1]`` tokens: 0 (one plain forward)
        unless ``learner.max_tokens_per_chunk`` is set and the sequence is longer."""
        return chunk_size(self.cfg.max_tokens_per_chunk, inp.shape[1])

    def policy_logprobs(self, inp, tgt, replay, *, grad, routing, score=None) -> PolicyForward:
        """See :class:`~t1async.learner.backend.LearnerBackend`. A sequence longer than
        ``learner.max_tokens_per_chunk`` runs the trunk with per-layer activation checkpointing
        and the LM head plus log-probs in chunks of that many positions, each recomputed in the
        backward (:func:`chunked_token_logprobs`): memory linear in tokens at a small constant,
        never the full [T, V] logits; bitwise the same log-probs and routing, replayed or not
        (gradients equal up to float summation order). With ``score`` the LM head runs only at its
        positions (:func:`scored_logprobs`)."""
        g = self.generation
        chunk = self._chunk(inp)
        with torch.set_grad_enabled(grad):
            if not chunk and score is None:
                out = self.policy(inp, routed_experts=replay, return_routing=routing)
                # scored as the samplers report (temperature, top-k, top-p, self.semantics); a sampled
                # id just outside this model's own nucleus is kept in it (counted by the learner)
                logp, outside = token_logprobs(out.logits, tgt, g.temperature, g.top_k, g.top_p,
                                               semantics=self.semantics, return_outside=True)
            else:
                with layer_checkpointing(self.policy.model) if chunk else nullcontext():
                    out = self.policy(inp, routed_experts=replay, return_routing=routing, logits_to_keep=1)
                logp, outside = scored_logprobs(self.policy.lm_head, out.hidden, tgt, g, chunk, self.semantics, score)
        return PolicyForward(logp, outside, out.routed_experts, out.router_experts)

    def reference_logprobs(self, inp, tgt, score=None) -> torch.Tensor:
        if self.reference is None:
            raise RuntimeError("no reference policy: learner.kl_coef is 0")
        g = self.generation
        chunk = self._chunk(inp)
        with torch.no_grad():
            if not chunk and score is None:
                return token_logprobs(self.reference(inp).logits, tgt, g.temperature, g.top_k, g.top_p,
                                      semantics=self.semantics)
            hidden = self.reference(inp, logits_to_keep=1).hidden
            return scored_logprobs(self.reference.lm_head, hidden, tgt, g, chunk, self.semantics, score)[0]

    def values(self, inp, *, grad) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("no critic: learner.critic is false")
        with torch.set_grad_enabled(grad):
            if not self._chunk(inp):
                return self.critic(inp)
            with layer_checkpointing(self.critic.backbone):
                return self.critic(inp)

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.policy.named_parameters()

    def save(self, folder: Path) -> None:
        """The policy as a model folder in ``model.path``'s layout and dtype (t1async/models/families.py
        :func:`save_model`), the critic and optimizers.pt. Where that dtype is narrower than the policy's (a
        bfloat16 folder, a float32 learner), optimizers.pt also keeps the policy's own weights
        (``policy_masters``, float32 master weights as mixed-precision training keeps them) for
        :meth:`load_state`: a resume continues from the exact weights, not from their rounding."""
        save_model(folder, self.model_cfg, self.policy, max_shard_bytes=self.cfg.checkpoint_shard_mb * 10**6)
        masters = ({n: p.detach() for n, p in self.policy.named_parameters()}
                   if checkpoint_rounds(self.model_cfg, self.policy) else None)
        self._save_state(folder, self.critic.state_dict() if self.critic is not None else None, masters)

    def load_state(self, folder: Path) -> bool:
        """Restore the critic, the optimisers and, where the checkpoint kept them (``policy_masters``, see
        :meth:`save`), the policy's exact weights over the rounded ones its model folder holds.

        Raises:
            ValueError: ``policy_masters`` of other names or shapes than this policy's parameters.
        """
        saved = self._critic_file(folder)
        if saved is not None and self.critic is not None:
            self.critic.load_state_dict(saved)
        opt = torch.load(folder / "optimizers.pt", weights_only=True)
        masters = opt.get("policy_masters")
        if masters is not None:
            params = dict(self.policy.named_parameters())
            if {k: tuple(v.shape) for k, v in masters.items()} != {k: tuple(p.shape) for k, p in params.items()}:
                raise ValueError(f"{folder}/optimizers.pt: its policy_masters do not match this policy's parameters; "
                                 "the checkpoint comes from another model")
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(masters[name])
        for o in (self.policy_opt, self.critic_opt):  # (weights loaded behind them: their float32 copies follow)
            if o is not None:
                o.sync_from_params()
        return self._load_optimizers(folder, opt)
