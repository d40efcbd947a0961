"""The learner backend interface: what a training engine does for the learner, and nothing else.

The learner (t1async/learner/loop.py) owns the data path, batch preparation (tensors, GAE,
advantages), the RL losses (t1async/learner/rl.py) and metrics. A backend owns the models (policy,
critic, optional frozen reference), their optimisers and their layouts, and answers five things:

- :meth:`LearnerBackend.policy_logprobs`: per-token log-probs of the targets under the distribution
  the samplers report (t1async/models/logprobs.py token_logprobs, under the ``SamplingSemantics`` of
  ``sampler.backend``), with the sampler's routed experts replayed or not;
- :meth:`LearnerBackend.values`: the critic's per-token values;
- :meth:`LearnerBackend.backward` / :meth:`LearnerBackend.step`: gradients and one optimiser step
  (gradient clipping, learning rate);
- :meth:`LearnerBackend.hf_weights`: the policy as named Hugging Face tensors for the broadcast;
- :meth:`LearnerBackend.save` / :meth:`LearnerBackend.load_state`: checkpoints, always Hugging
  Face safetensors + config.json for the policy whatever the backend (so a run can switch
  backend on resume; samplers, eval and transformers load them).

Backends (``learner.backend``): ``torch`` (t1async/learner/torch_backend.py, the plain-PyTorch model of
t1async/models/model.py; the CPU default) and ``megatron`` (t1async/learner/megatron/backend.py, megatron-core's
GPTModel; ``pip install 't1async[megatron]'``). tests/unit/learner/test_megatron.py holds both to one
another on the same weights and batch.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from loguru import logger
from safetensors.torch import load_file, save_file

from t1async.config import GenerationConfig, LearnerConfig, ModelConfig
from t1async.models.logprobs import EMBEDDED, SamplingSemantics

__all__ = ["BACKENDS", "ONE_PROCESS", "AdamWPair", "LearnerBackend", "MasterWeightAdamW", "PolicyForward",
           "ShardedAdamW", "chunk_size", "make_backend"]

# learner.backend -> "module:class", imported on use (megatron-core is an optional extra)
BACKENDS = {
    "torch": "t1async.learner.torch_backend:TorchBackend",
    "megatron": "t1async.learner.megatron.backend:MegatronBackend",
}


@dataclass
class PolicyForward:
    """What :meth:`LearnerBackend.policy_logprobs` returns (tensors on the backend's device).

    Attributes:
        logp: float32 [B, T]: log-prob of each target under the processed sampling distribution.
        outside: bool [B, T]: the target was outside this model's own top-k/top-p set (kept anyway).
        routed_experts: int64 [B, T, L, K]: experts used (the replayed ones under replay), or
            None unless asked for routing.
        router_experts: int64 [B, T, L, K]: the routers' own top-k in the same forward, or None.
    """

    logp: torch.Tensor
    outside: torch.Tensor
    routed_experts: torch.Tensor | None = None
    router_experts: torch.Tensor | None = None


class LearnerBackend(Protocol):
    """A learner's training engine. Constructed as ``cls(cfg, model_cfg, generation, init)``:
    ``init`` is a checkpoint folder to load the policy from (resume or warm start) or None
    (seeded random init, the same for every backend: t1async/models/model.py's init)."""

    device: torch.device

    def policy_logprobs(self, inp: torch.Tensor, tgt: torch.Tensor, replay: torch.Tensor | None, *, grad: bool,
                        routing: bool, score: torch.Tensor | None = None) -> PolicyForward:
        """inp, tgt: int64 [B, T] on ``device``; replay: integer [B, T, L, K] expert ids or None.
        ``grad``: keep the graph for a backward; ``routing``: fill the routing fields. ``score``: bool [B, T], the
        positions whose log-probs are read (the sampled tokens); a backend may leave the others 0 and skip their
        LM head (the torch backend does; megatron scores every position)."""
        ...

    def reference_logprobs(self, inp: torch.Tensor, tgt: torch.Tensor, score: torch.Tensor | None = None
                           ) -> torch.Tensor:
        """float32 [B, T] log-probs under the frozen reference (no gradient); ``score`` as for
        :meth:`policy_logprobs`. Raises RuntimeError when the backend keeps no reference (``learner.kl_coef`` = 0)."""
        ...

    def values(self, inp: torch.Tensor, *, grad: bool) -> torch.Tensor:
        """float32 [B, T] critic values of the state after each input token."""
        ...

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, *, policy: bool, policy_lr: float) -> float | None:
        """Clip and step the critic; with ``policy``, clip and step the policy at ``policy_lr``
        and return its gradient norm before clipping (None otherwise)."""
        ...

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The policy's weights under their Hugging Face names (t1async/models/model.py)."""
        ...

    def num_parameters(self) -> int: ...

    def save(self, folder: Path) -> None:
        """Write config.json + model.safetensors (policy, HF), critic.safetensors (HF names
        ``backbone.*``, ``head.*``) and optimizers.pt into ``folder``."""
        ...

    def load_state(self, folder: Path) -> bool:
        """Restore the critic and the optimisers saved by :meth:`save` (the policy was loaded
        at construction). Returns False when the optimiser file is another backend's (their
        layouts differ): the optimisers then start fresh."""
        ...

    def close(self) -> None:
        """Release what the backend started (the megatron backend's expert-parallel ranks)."""
        ...


def make_backend(name: str, cfg: LearnerConfig, model_cfg: ModelConfig, generation: GenerationConfig,
                 init: str | Path | None, semantics: SamplingSemantics = EMBEDDED) -> LearnerBackend:
    """Build backend ``name`` (a key of :data:`BACKENDS`), scoring tokens under ``semantics`` (the
    samplers' log-prob semantics, t1async/models/logprobs.py :func:`sampling_semantics`).

    Raises:
        ValueError: unknown name. ImportError: the backend's optional dependency is missing
            (the message says which extra to install).
    """
    if name not in BACKENDS:
        raise ValueError(f"learner.backend={name!r} is not one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(cfg, model_cfg, generation, init, semantics=semantics)


def chunk_size(max_tokens_per_chunk: int, positions: int) -> int:
    """Positions per chunk of a forward over ``positions`` positions (a micro-batch's padded
    length): ``learner.max_tokens_per_chunk`` when it is set and exceeded (LM head in chunks,
    decoder layers recomputed, on both backends), else 0 (one plain forward)."""
    return max_tokens_per_chunk if max_tokens_per_chunk and positions > max_tokens_per_chunk else 0


# the layout keys of an optimiser file and their values for one process (files without a key predate it)
ONE_PROCESS = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1, "distributed_optimizer": 0}


class MasterWeightAdamW:
    """``torch.optim.AdamW`` that steps float32 master copies of 16-bit (bfloat16 / float16)
    parameters and copies the result back, rounded, into them (mixed-precision training,
    Micikevicius et al. 2018; what Megatron's ``Float16OptimizerWithFloat16Params`` and its
    distributed optimizer keep as "main params"). float32 parameters are stepped in place, as
    plain AdamW does: with only float32 parameters this is AdamW itself, and its state dict is
    AdamW's.

    Why: a bfloat16 weight has 8 significant bits, so an update smaller than about 1/256 of the
    weight rounds away. At RL learning rates (1e-6, Adam's step about lr per element) almost every
    update vanished: measured with the torch backend in bfloat16, 5 steps at lr 1e-6 changed 1.7 %
    of the policy's elements against 86 % in float32 (tests/unit/learner/test_learner.py).

    Args:
        params: the model's parameters (any dtypes). lr, weight_decay: AdamW's.

    ``param_groups``, ``state`` and ``step`` / ``zero_grad`` / ``state_dict`` /
    ``load_state_dict`` behave as AdamW's. The state dict adds ``master_weights`` (the float32
    copies of the 16-bit parameters, in parameter order) when there are any; loading a state dict
    without them (older files, or saved in float32) starts them from the parameters' values.
    """

    def __init__(self, params, *, lr: float, weight_decay: float):
        self.params = list(params)
        self.masters = [p.detach().float().clone() if p.dtype in (torch.bfloat16, torch.float16) else p
                        for p in self.params]
        self._low = [i for i, (p, m) in enumerate(zip(self.params, self.masters)) if m is not p]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)

    @property
    def param_groups(self) -> list[dict]:
        return self.opt.param_groups

    @property
    def state(self):
        return self.opt.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.opt.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the masters (each 16-bit parameter's gradient cast to float32 first), then
        each 16-bit parameter set to its master, rounded to nearest."""
        for i in self._low:
            g = self.params[i].grad
            self.masters[i].grad = None if g is None else g.float()
        self.opt.step()
        for i in self._low:
            self.params[i].copy_(self.masters[i])

    def state_dict(self) -> dict:
        sd = self.opt.state_dict()
        if self._low:
            sd["master_weights"] = [self.masters[i].detach().clone() for i in self._low]
        return sd

    @torch.no_grad()
    def sync_from_params(self) -> None:
        """The float32 masters set to the parameters' values: after weights were loaded into the model behind the
        optimiser's back (a checkpoint's critic, exact policy weights), so that the next step moves the loaded
        weights instead of writing the masters of the weights before the load back into the model."""
        for i in self._low:
            self.masters[i].copy_(self.params[i])

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """AdamW's state, and the masters from ``sd["master_weights"]`` (else from the parameters).

        Raises:
            ValueError: ``master_weights`` of other count or shapes than these 16-bit parameters.
        """
        sd = dict(sd)
        saved = sd.pop("master_weights", None)
        self.opt.load_state_dict(sd)
        if saved is not None and [tuple(t.shape) for t in saved] != [tuple(self.masters[i].shape) for i in self._low]:
            raise ValueError(f"optimiser state: {len(saved)} master weights do not match this model's "
                             f"{len(self._low)} 16-bit parameters")
        for j, i in enumerate(self._low):
            self.masters[i].copy_(saved[j] if saved is not None else self.params[i])


class ShardedAdamW:
    """AdamW for one rank of a data-parallel group: its own weights (``own``: the experts) through
    :class:`t1async.learner.backend.MasterWeightAdamW`, and the weights every rank of the group holds
    (``replicated``, identical on each, their gradients already summed over the group) with
    ZeRO stage 1 (Rajbhandari et al. 2020; megatron-core's distributed optimizer): their float32
    masters and AdamW moments are one flat buffer split into ``size`` contiguous shards, this rank
    keeps and steps shard ``rank`` only, and the updated shards are all-gathered into every rank's
    weights (rounded to their dtype). AdamW is elementwise, so the weights after a step are those
    of unsharded AdamW, bit for bit.

    Args:
        own, replicated: parameters. lr, weight_decay: AdamW's. group, rank, size: the
            data-parallel process group, this rank's index in it and its size.

    Behaves as an optimiser for the backend: ``param_groups`` (both parts' groups, so a learning
    rate set on each reaches both), ``zero_grad``, ``step``, ``state_dict``, ``load_state_dict``.
    """

    def __init__(self, own, replicated, *, lr: float, weight_decay: float, group, rank: int, size: int):
        self.own = MasterWeightAdamW(own, lr=lr, weight_decay=weight_decay)
        self.replicated = list(replicated)
        self.group, self.rank, self.size = group, rank, size
        self.numel = sum(p.numel() for p in self.replicated)
        self.per = -(-self.numel // size)
        lo = rank * self.per
        flat = self._flat([p.detach() for p in self.replicated])
        self.shard = flat[lo:lo + self.per].clone()  # float32 masters of this rank's shard (a leaf)
        self.opt = torch.optim.AdamW([self.shard], lr=lr, weight_decay=weight_decay)

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The replicated weights' tensors as one float32 vector, zero-padded to size x per."""
        dev = self.replicated[0].device if self.replicated else torch.device("cpu")
        parts = [t.float().reshape(-1) for t in tensors]
        return torch.cat(parts + [torch.zeros(self.per * self.size - self.numel, device=dev)])

    @property
    def param_groups(self) -> list[dict]:
        return self.own.param_groups + self.opt.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.own.zero_grad(set_to_none)
        for p in self.replicated:
            p.grad = None
        self.shard.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Step the own weights, then this rank's shard (its slice of the summed gradients), then
        all-gather the shards into every replicated weight."""
        self.own.step()
        if not self.replicated:
            return
        lo = self.rank * self.per
        grads = self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.replicated])
        self.shard.grad = grads[lo:lo + self.per].clone()
        del grads
        self.opt.step()
        full = self.shard.new_empty(self.per * self.size)
        dist.all_gather_into_tensor(full, self.shard.detach(), group=self.group)
        at = 0
        for p in self.replicated:
            p.copy_(full[at:at + p.numel()].view_as(p))
            at += p.numel()

    @torch.no_grad()
    def sync_from_params(self) -> None:
        """This rank's float32 shard (and the own weights' masters) set to the weights' values: see
        :meth:`MasterWeightAdamW.sync_from_params` (without it the next step all-gathers the shard of the weights
        before a load into every rank's weights)."""
        self.own.sync_from_params()
        if self.replicated:
            lo = self.rank * self.per
            self.shard.copy_(self._flat([p.detach() for p in self.replicated])[lo:lo + self.per])

    def state_dict(self) -> dict:
        return {"own": self.own.state_dict(), "shard": self.opt.state_dict(), "master_shard": self.shard.detach().clone(),
                "shard_of": [self.rank, self.size, self.numel]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Raises: ValueError: a state saved for another shard (rank, group size or weight count)."""
        if list(sd.get("shard_of", [])) != [self.rank, self.size, self.numel]:
            raise ValueError(f"optimiser state of shard {sd.get('shard_of')} (rank, ranks, weights), this rank "
                             f"holds {[self.rank, self.size, self.numel]}")
        self.own.load_state_dict(sd["own"])
        self.opt.load_state_dict(sd["shard"])
        self.shard.copy_(sd["master_shard"])


class AdamWPair:
    """The optimisers both backends share: AdamW (:class:`MasterWeightAdamW`: float32 masters of
    16-bit parameters) for the policy and for the critic, global-norm clipping, and their
    checkpoint file.

    A subclass sets ``self.cfg`` (LearnerConfig) and calls :meth:`_init_optimizers` with its
    policy and critic modules (``self.policy``, ``self.critic``) built; ``self.critic`` is None
    under ``learner.critic: false`` (no critic weights, optimiser state or file at all). AdamW and
    the clip are elementwise and a sum over every element, so a fused layout (Megatron's qkv, fc1)
    takes the same step as the split one.
    """

    cfg: LearnerConfig
    policy: torch.nn.Module
    critic: torch.nn.Module | None
    name = "?"

    def _init_optimizers(self) -> None:
        cfg = self.cfg
        self.policy_opt = MasterWeightAdamW(self.policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.critic_opt = (MasterWeightAdamW(self.critic.parameters(), lr=cfg.critic_lr, weight_decay=cfg.weight_decay)
                           if self.critic is not None else None)

    def zero_grad(self) -> None:
        self.policy_opt.zero_grad(set_to_none=True)
        if self.critic_opt is not None:
            self.critic_opt.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, *, policy: bool, policy_lr: float) -> float | None:
        if self.critic is not None:
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.cfg.max_grad_norm)
            self.critic_opt.step()
        if not policy:
            return None
        gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.max_grad_norm)
        for group in self.policy_opt.param_groups:
            group["lr"] = policy_lr
        self.policy_opt.step()
        return float(gn)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.policy.parameters())

    def close(self) -> None:
        """Nothing to release (one process)."""

    # critic and optimiser files (the policy's are the subclass's: HF config.json + safetensors)
    def _save_state(self, folder: Path, critic_hf: dict[str, torch.Tensor] | None,
                    policy_masters: dict[str, torch.Tensor] | None = None) -> None:
        """critic.safetensors (unless there is no critic) and optimizers.pt; ``policy_masters`` (the policy's
        own weights by parameter name, when the checkpoint's model folder holds them rounded to a narrower dtype)
        goes into optimizers.pt as ``policy_masters``."""
        if critic_hf is not None:
            save_file({k: v.detach().contiguous().cpu() for k, v in critic_hf.items()},
                      str(folder / "critic.safetensors"))
        extra = {"policy_masters": policy_masters} if policy_masters is not None else {}
        torch.save({"policy": self.policy_opt.state_dict(),
                    "critic": self.critic_opt.state_dict() if self.critic_opt is not None else None,
                    "backend": self.name, **self.parallel_sizes(), **extra},
                   folder / "optimizers.pt")

    def parallel_sizes(self) -> dict[str, int]:
        """``{"tensor_parallel", "pipeline_parallel", "expert_parallel", "distributed_optimizer"}`` of
        this backend (1, 1, 1, 0 for one process): an optimiser state is only valid for the layout
        it was saved under."""
        return {k: int(getattr(self, k, v)) for k, v in ONE_PROCESS.items()}

    def _load_optimizers(self, folder: Path, opt: dict | None = None) -> bool:
        """Load optimizers.pt (or ``opt``, its contents already read) if it was written by this backend with
        these parallel sizes (older files, without a ``backend`` key, are the torch backend's; without a size
        key, one process's); returns False (fresh optimisers) otherwise."""
        opt = opt if opt is not None else torch.load(folder / "optimizers.pt", weights_only=True)
        if opt.get("backend", "torch") != self.name or any(opt.get(k, ONE_PROCESS[k]) != v
                                                           for k, v in self.parallel_sizes().items()):
            return False
        self.policy_opt.load_state_dict(opt["policy"])
        if self.critic_opt is not None and opt.get("critic") is not None:
            self.critic_opt.load_state_dict(opt["critic"])
        return True

    def _critic_file(self, folder: Path) -> dict[str, torch.Tensor] | None:
        """The saved critic to restore: None when this learner has no critic, or when the checkpoint
        has none (saved under ``learner.critic: false``; the critic then starts afresh, logged)."""
        if self.critic is None:
            return None
        path = folder / "critic.safetensors"
        if not path.exists():
            logger.warning("{} holds no critic (saved with learner.critic=false): the critic starts from its "
                           "initial weights", folder)
            return None
        return load_file(str(path))
