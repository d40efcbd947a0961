"""The ``torch`` learner backend: t1async/model.py's plain-PyTorch Qwen3-MoE as policy, critic
and reference (the CPU default; the interface is t1async/backend.py)."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn as nn

from t1async.backend import AdamWPair, PolicyForward
from t1async.config import GenerationConfig, LearnerConfig, ModelConfig
from t1async.model import Qwen3MoeForCausalLM
from t1async.rl import token_logprobs

__all__ = ["TorchBackend", "ValueModel", "load_policy"]


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


def load_policy(model_cfg: ModelConfig, init: str | Path | None) -> Qwen3MoeForCausalLM:
    """The policy from checkpoint folder ``init``, or a fresh seeded one (the caller seeds torch).

    Raises:
        ValueError: the checkpoint's architecture differs from ``model_cfg``.
    """
    if not init:
        return Qwen3MoeForCausalLM(model_cfg)
    policy = Qwen3MoeForCausalLM.from_pretrained(init)
    if policy.cfg != model_cfg:
        raise ValueError(f"checkpoint {init} has a model config that differs from `model`")
    return policy


class TorchBackend(AdamWPair):
    """Policy, critic (:class:`ValueModel`) and, with ``cfg.kl_coef`` > 0, a frozen reference (the
    warm start ``cfg.init_checkpoint``, else a copy of the initial policy), all float32 on CPU by
    default; AdamW for each (t1async/backend.py).

    Args:
        cfg, model_cfg: learner settings and policy architecture.
        generation: the samplers' temperature, top-k and top-p (log-probs are of that distribution).
        init: checkpoint folder of the policy, or None (seeded init).
        device, dtype: where and in which dtype the models run (the critic's head stays float32).
    """

    name = "torch"

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, generation: GenerationConfig,
                 init: str | Path | None = None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.cfg, self.generation = cfg, generation
        self.device = torch.device(device)
        self.policy = load_policy(model_cfg, init)
        self.critic = ValueModel(self.policy)
        self.reference: Qwen3MoeForCausalLM | None = None
        if cfg.kl_coef > 0:
            self.reference = (Qwen3MoeForCausalLM.from_pretrained(cfg.init_checkpoint) if cfg.init_checkpoint
                              else copy.deepcopy(self.policy)).eval().requires_grad_(False)
        if self.device.type != "cpu" or dtype != torch.float32:
            for m in (self.policy, self.critic, self.reference):
                if m is not None:
                    m.to(self.device, dtype)
            self.critic.head.float()
        self._init_optimizers()

    def policy_logprobs(self, inp, tgt, replay, *, grad, routing) -> PolicyForward:
        g = self.generation
        with torch.set_grad_enabled(grad):
            out = self.policy(inp, routed_experts=replay, return_routing=routing)
            # scored under the sampler's processing (temperature, top-k, top-p); a sampled id
            # just outside this model's own nucleus is kept in it (counted by the learner)
            logp, outside = token_logprobs(out.logits, tgt, g.temperature, g.top_k, g.top_p, return_outside=True)
        return PolicyForward(logp, outside, out.routed_experts, out.router_experts)

    def reference_logprobs(self, inp, tgt) -> torch.Tensor:
        if self.reference is None:
            raise RuntimeError("no reference policy: learner.kl_coef is 0")
        g = self.generation
        with torch.no_grad():
            return token_logprobs(self.reference(inp).logits, tgt, g.temperature, g.top_k, g.top_p)

    def values(self, inp, *, grad) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return self.critic(inp)

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.policy.named_parameters()

    def save(self, folder: Path) -> None:
        self.policy.save_pretrained(folder)
        self._save_state(folder, self.critic.state_dict())

    def load_state(self, folder: Path) -> bool:
        self.critic.load_state_dict(self._critic_file(folder))
        return self._load_optimizers(folder)
