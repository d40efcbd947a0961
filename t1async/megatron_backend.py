"""The ``megatron`` learner backend: megatron-core 0.16.1's GPTModel as policy, critic and reference.

The interface is t1async/backend.py; the Hugging Face <-> Megatron weight layouts are
t1async/megatron_convert.py. What it builds (facts in ../shared/DESIGN.md §3, read from
megatron-core 0.16.1's sources):

- the local layer spec (``get_gpt_layer_local_spec``, no Transformer Engine): RMSNorm, q/k
  layernorm, SwiGLU experts (``SequentialMLP``), no biases, RoPE (rotate-half), softmax router
  in float32 (``moe_router_dtype='fp32'``; bf16 routers fail in backward), top-k renormalised
  (``moe_router_pre_softmax=False``) when ``norm_topk_prob``, no aux loss, no dropout;
- routing replay (R3) with megatron-core's own ``RouterReplay`` (``moe_enable_routing_replay``,
  unfused router: the fused path skips replay): REPLAY_FORWARD with the sampler's rows, RECORD to
  read what the router chose; indices are set and cleared around every forward;
- the critic: the same trunk (its own copy, its own router, no replay) whose ``output_layer`` is
  a float32 ``Linear(hidden, 1)`` with a bias on the final-norm hidden states, as
  t1async/torch_backend.py's ``ValueModel``;
- AdamW and global-norm clipping shared with the torch backend (t1async/backend.py); with one
  process this is the whole distributed optimizer's job.

Initial weights are t1async/model.py's (same seed, same numbers as the torch backend), converted.

On CPU megatron-core 0.16.1 runs with three shims, applied only when CUDA is absent:
``torch.cuda.current_device`` returns the CPU device (routers move their weight to it), an
inference RNG tracker (no CUDA RNG), and ``moe_utils.te_general_gemm = None`` (it is otherwise
called without Transformer Engine). A causal mask is passed explicitly on CPU (the default one is
built on CUDA). The ``alltoall`` dispatcher needs CUDA.

Parallelism: one process (tensor, pipeline and expert parallel sizes 1). The converter already
maps expert- and pipeline-parallel ranks; wiring several learner processes is left (README).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from t1async.backend import AdamWPair, PolicyForward
from t1async.config import GenerationConfig, LearnerConfig, MegatronConfig, ModelConfig
from t1async.megatron_convert import CRITIC, POLICY, hf_to_megatron, megatron_to_hf
from t1async.model import save_hf
from t1async.rl import token_logprobs
from t1async.torch_backend import ValueModel, load_policy

try:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # the optional extra
    raise ImportError(f"learner.backend=megatron needs megatron-core: pip install 't1async[megatron]' ({e})") from None

__all__ = ["MegatronBackend", "build_gpt", "init_megatron", "replay_rows", "transformer_config"]


def init_megatron(device: torch.device, seed: int = 0) -> None:
    """Make this process a one-rank Megatron world (idempotent).

    Starts torch.distributed's default group if it is not started (gloo on CPU, nccl on CUDA,
    world size 1, an in-memory store), Megatron's model-parallel groups (all sizes 1) and its RNG
    tracker; on CPU installs the shims described in the module docstring. The learner's weight
    broadcast uses its own process groups (t1async/weight_sync.py), never the default one.
    """
    import torch.distributed as dist

    if device.type == "cpu" and not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    if not hasattr(moe_utils, "te_general_gemm"):  # no Transformer Engine: the router's GEMM is torch's
        moe_utils.te_general_gemm = None  # (measured on an H200: NameError there too, not only on CPU)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    from megatron.core.tensor_parallel import random as mrandom

    if device.type == "cpu":
        mrandom.initialize_rng_tracker(inference_rng_tracker=True)
    elif not mrandom.get_cuda_rng_tracker().is_initialized():
        mrandom.model_parallel_cuda_manual_seed(seed)


def transformer_config(cfg: ModelConfig, *, replay: bool, dtype: torch.dtype, device: torch.device,
                       dispatcher: str = "auto", expert_parallel: int = 1) -> TransformerConfig:
    """Megatron's TransformerConfig for the HF Qwen3-MoE architecture ``cfg`` (tensor and pipeline
    parallel sizes 1; ``expert_parallel`` must match Megatron's initialised groups).

    Raises:
        ValueError: ``alltoall`` asked for on CPU.
    """
    if dispatcher == "auto":
        dispatcher = "alltoall" if device.type == "cuda" else "allgather"
    if dispatcher == "alltoall" and device.type != "cuda":
        raise ValueError("learner.megatron.dispatcher=alltoall needs CUDA; use allgather on CPU")
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.moe_intermediate_size,
        moe_ffn_hidden_size=cfg.moe_intermediate_size, num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.num_experts_per_tok, moe_router_pre_softmax=not cfg.norm_topk_prob,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        moe_router_dtype="fp32", moe_router_fusion=False, moe_enable_routing_replay=replay,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type=dispatcher,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=device.type == "cpu",
        perform_initialization=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        expert_model_parallel_size=expert_parallel)


class _ValueHead(nn.Module):
    """The critic's head in GPTModel's ``output_layer`` slot: float32 ``hidden -> 1`` with a bias."""

    def __init__(self, hidden: int, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden, device=device))
        self.bias = nn.Parameter(torch.zeros(1, device=device))

    def forward(self, x: torch.Tensor, weight=None, runtime_gather_output=None):
        return F.linear(x.float(), self.weight, self.bias), None


def build_gpt(cfg: ModelConfig, hf: dict[str, torch.Tensor], *, critic: bool = False, replay: bool = False,
              dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
              dispatcher: str = "auto", ep_rank: int = 0, ep_size: int = 1) -> GPTModel:
    """A GPTModel holding the HF weights ``hf`` (policy layout, or the critic's with ``critic``);
    with ``ep_size`` > 1 (Megatron's expert-parallel groups of that size initialised) only this
    rank's experts.

    Raises:
        RuntimeError: the converted weights do not cover the model's parameters exactly.
    """
    tc = transformer_config(cfg, replay=replay, dtype=dtype, device=device, dispatcher=dispatcher,
                            expert_parallel=ep_size)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    model = GPTModel(tc, spec, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=cfg.rope_theta,
                     share_embeddings_and_output_weights=cfg.tie_word_embeddings and not critic)
    if critic:
        model.output_layer = _ValueHead(cfg.hidden_size, device)
    model.to(device)
    RouterReplay.clear_global_router_replay_instances()  # each router keeps its own; no process-wide list
    load_megatron(model, hf_to_megatron(hf, cfg, CRITIC if critic else POLICY, ep_rank=ep_rank, ep_size=ep_size))
    return model


def load_megatron(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Copy Megatron-named tensors into ``model``'s parameters (cast to their dtype).

    Raises:
        RuntimeError: a parameter without a tensor, or a tensor without a parameter.
    """
    params = dict(model.named_parameters())
    if set(params) != set(sd):
        raise RuntimeError(f"Megatron weights: missing {sorted(set(params) - set(sd))[:5]}, "
                           f"unexpected {sorted(set(sd) - set(params))[:5]}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(sd[n])


def replay_rows(routed: torch.Tensor, num_experts: int, lengths: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Routed experts [B, T, L, K] -> Megatron's replay rows: per layer, int64 [T * B, K] in its
    token order (sequence-major: row s * B + b is token s of sequence b).

    Megatron builds a token's routing map by scattering its K ids, so a repeated id within a row
    would silently route to fewer than K experts and break the dispatcher's token count. Padded
    positions (``t >= lengths[b]``) get the distinct ids ``arange(K) % num_experts``.

    Raises:
        ValueError: a real row repeats an expert id (the sampler's rows never do).
    """
    B, T, L, K = routed.shape
    r = routed.long()
    if lengths is not None:
        pad = torch.arange(T, device=r.device)[None, :] >= lengths.to(r.device)[:, None]  # [B, T]
        r = torch.where(pad[:, :, None, None], torch.arange(K, device=r.device) % num_experts, r)
    s = r.sort(dim=-1).values
    if K > 1 and bool((s[..., 1:] == s[..., :-1]).any()):
        b, t, layer = (s[..., 1:] == s[..., :-1]).any(-1).nonzero()[0].tolist()
        raise ValueError(f"routed experts repeat an expert id at sequence {b}, token {t}, layer {layer}: "
                         f"{r[b, t, layer].tolist()}; Megatron's replay needs K distinct ids per row")
    return [r[:, :, layer].transpose(0, 1).reshape(T * B, K) for layer in range(L)]


class MegatronBackend(AdamWPair):
    """Policy (with routing replay), critic and, with ``cfg.kl_coef`` > 0, a frozen reference as
    megatron-core GPTModels in one process; settings in ``cfg.megatron``
    (:class:`t1async.config.MegatronConfig`).

    Args:
        cfg, model_cfg, generation, init: as :class:`t1async.backend.LearnerBackend`.
        device, dtype: override ``cfg.megatron.device`` / ``dtype`` (the bench uses them).

    Raises:
        ValueError: a parallel size other than 1, alltoall on CPU, a checkpoint of another
            architecture.
    """

    name = "megatron"

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, generation: GenerationConfig,
                 init: str | Path | None = None, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None):
        mc: MegatronConfig = cfg.megatron
        sizes = {"tensor_parallel": mc.tensor_parallel, "pipeline_parallel": mc.pipeline_parallel,
                 "expert_parallel": mc.expert_parallel}
        if any(v != 1 for v in sizes.values()):
            raise ValueError(f"learner.megatron {sizes}: only 1 runs today (the learner is one process)")
        self.cfg, self.generation, self.model_cfg = cfg, generation, model_cfg
        want = device or mc.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(want)
        self.dtype = dtype or {"float32": torch.float32, "bfloat16": torch.bfloat16}[mc.dtype]
        init_megatron(self.device)
        # the torch backend's initial weights (same seed, same numbers), converted
        hf_policy = load_policy(model_cfg, init)
        kw = dict(dtype=self.dtype, device=self.device, dispatcher=mc.dispatcher)
        self.policy = build_gpt(model_cfg, hf_policy.state_dict(), replay=True, **kw)
        self.critic = (build_gpt(model_cfg, ValueModel(hf_policy).state_dict(), critic=True, **kw) if cfg.critic
                       else None)  # learner.critic: false builds none
        self.reference: GPTModel | None = None
        if cfg.kl_coef > 0:
            ref = load_policy(model_cfg, cfg.init_checkpoint) if cfg.init_checkpoint else hf_policy
            self.reference = build_gpt(model_cfg, ref.state_dict(), **kw).eval().requires_grad_(False)
        del hf_policy
        self._routers = [layer.mlp.router for layer in self.policy.decoder.layers]
        self._router_inputs: list[torch.Tensor | None] = [None] * len(self._routers)
        for i, r in enumerate(self._routers):
            r.register_forward_pre_hook(lambda mod, args, i=i: self._keep_router_input(i, args[0]))
        self._capture = False
        self._masks: dict[int, torch.Tensor] = {}
        self._init_optimizers()

    # ---- forward ------------------------------------------------------------------------
    def _keep_router_input(self, i: int, x: torch.Tensor) -> None:
        if self._capture:
            self._router_inputs[i] = x.detach()

    def _run(self, model: GPTModel, inp: torch.Tensor) -> torch.Tensor:
        """GPTModel forward of inp [B, T]: its output [B, T, V] (or [B, T, 1] for the critic)."""
        B, T = inp.shape
        pos = torch.arange(T, device=self.device).expand(B, T)
        mask = None  # CUDA: Megatron's own causal mask
        if self.device.type == "cpu":
            if T not in self._masks:
                self._masks[T] = torch.ones(T, T, dtype=torch.bool).triu(1)[None, None]  # True: masked
            mask = self._masks[T]
        return model(inp.to(self.device), pos, mask)

    def policy_logprobs(self, inp, tgt, replay, *, grad, routing) -> PolicyForward:
        g, cfg = self.generation, self.model_cfg
        B, T = inp.shape
        replays = [r.router_replay for r in self._routers]
        if replay is not None:
            rows = replay_rows(replay.to(self.device), cfg.num_experts)
            for rr, row in zip(replays, rows):
                rr.set_target_indices(row)
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        elif routing:
            for rr in replays:
                rr.set_router_replay_action(RouterReplayAction.RECORD)
        self._capture = routing
        try:
            with torch.set_grad_enabled(grad):
                logits = self._run(self.policy, inp).float()
                logp, outside = token_logprobs(logits, tgt, g.temperature, g.top_k, g.top_p, return_outside=True)
            used = own = None
            if routing:
                own = torch.stack([self._own_topk(r, x, B, T) for r, x in zip(self._routers, self._router_inputs)], 2)
                if replay is None:
                    used = torch.stack([rr.get_recorded_indices().view(T, B, -1).transpose(0, 1) for rr in replays], 2)
                else:
                    used = replay.to(self.device).long()
        finally:
            self._capture = False
            self._router_inputs = [None] * len(self._routers)
            for rr in replays:
                rr.clear_indices()
                rr.clear_router_replay_action()
        return PolicyForward(logp, outside, used, own)

    def _own_topk(self, router: nn.Module, x: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """The router's own top-k [B, T, K] from its input (what it would choose without replay)."""
        logits = x.reshape(-1, x.shape[-1]).float() @ router.weight.float().t()  # [T * B, E], float32 as it routes
        return logits.topk(self.model_cfg.num_experts_per_tok, dim=-1).indices.view(T, B, -1).transpose(0, 1)

    def reference_logprobs(self, inp, tgt) -> torch.Tensor:
        if self.reference is None:
            raise RuntimeError("no reference policy: learner.kl_coef is 0")
        g = self.generation
        with torch.no_grad():
            return token_logprobs(self._run(self.reference, inp).float(), tgt, g.temperature, g.top_k, g.top_p)

    def values(self, inp, *, grad) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("no critic: learner.critic is false")
        with torch.set_grad_enabled(grad):
            return self._run(self.critic, inp).squeeze(-1)

    # ---- weights and checkpoints ----------------------------------------------------------
    def megatron_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in model.named_parameters()}

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The policy under its HF names (contiguous tensors on the backend's device)."""
        sd = megatron_to_hf(self.megatron_state(self.policy), self.model_cfg, POLICY)
        return {k: v.contiguous() for k, v in sd.items()}

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.hf_state().items()

    def critic_hf_state(self) -> dict[str, torch.Tensor]:
        sd = megatron_to_hf(self.megatron_state(self.critic), self.model_cfg, CRITIC)
        return {k: v.contiguous() for k, v in sd.items()}

    def save(self, folder: Path) -> None:
        save_hf(folder, self.model_cfg, {k: v.cpu() for k, v in self.hf_state().items()})
        self._save_state(folder, self.critic_hf_state() if self.critic is not None else None)

    def load_state(self, folder: Path) -> bool:
        saved = self._critic_file(folder)
        if saved is not None and self.critic is not None:
            load_megatron(self.critic, hf_to_megatron(saved, self.model_cfg, CRITIC))
        return self._load_optimizers(folder)
