"""The Megatron backend's state I/O: parameter counts, Hugging Face weights gathered from every
rank, checkpoints (weights, per-rank optimiser files) and loading them back.

A mixin of :class:`t1async.learner.megatron.backend.MegatronBackend`: it reads the backend's
models, ranks and optimisers (``self.policy``, ``self._ranks``, ...), set up there. The calls named
in ``FOLLOWER_OPS`` (``gather_hf``, ``save_optimizers``, ``load_rank_optimizers``, ``load_hf``) run
on every rank, announced by rank 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from loguru import logger
from torch import nn

from t1async.learner.backend import ONE_PROCESS
from t1async.learner.megatron.families import (
    checkpoint_state,
    from_converter,
    hf_to_megatron,
    megatron_family,
    megatron_to_hf,
    merge_tp,
    shard_tp,
    to_converter,
    tp_partition,
)
from t1async.learner.megatron.families.convert import CRITIC, POLICY
from t1async.learner.megatron.model import load_megatron, megatron_tensors
from t1async.learner.megatron.ranks import from_bytes, gather_bytes, gather_tensors, scatter_bytes, to_bytes
from t1async.models.families import checkpoint_rounds, save_model
from t1async.models.model import save_hf
from t1async.weights.buckets import is_expert


def _cpu_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in sd.items()}


class MegatronState:
    """State I/O of :class:`~t1async.learner.megatron.backend.MegatronBackend` (module docstring)."""

    def num_parameters(self) -> int:
        """Parameters of the whole policy (every rank's experts, slices and stages; counted on rank 0
        from the HF model it built them from, 0 on followers)."""
        return self._num_parameters

    # ---- weights and checkpoints ----------------------------------------------------------
    def megatron_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's Megatron-named parameters of ``model`` and the buffers checkpoints carry (a sigmoid router's
        ``expert_bias``; t1async/learner/megatron/model.py :func:`megatron_tensors`), detached, its own experts only."""
        return {n: p.detach() for n, p in megatron_tensors(model).items()}

    def _gather_hf(self, role: str, grads: bool = False) -> dict[str, torch.Tensor] | None:
        """The whole ``role`` model (policy or critic) in HF layout on rank 0 (the torch model's names:
        t1async/learner/megatron/families/ :func:`from_converter`), every rank's experts,
        tensor-parallel slices (:func:`merge_tp`) and pipeline stages gathered there; None on
        followers. ``grads``: the parameters' gradients instead (zeros where none), laid out as the weights."""
        hf = self._gather_converter_names(role, grads)
        return None if hf is None else from_converter(self.model_cfg, hf)

    def _gather_converter_names(self, role: str, grads: bool = False) -> dict[str, torch.Tensor] | None:
        model, layout = (self.policy, POLICY) if role == "policy" else (self.critic, CRITIC)
        local = self.megatron_state(model)
        if grads:
            local = {k: (torch.zeros_like(v) if getattr(v, "grad", None) is None else v.grad.detach())
                     for k, v in megatron_tensors(model).items()}
        n, tp, pp = self.expert_parallel, self.tensor_parallel, self.pipeline_parallel
        if self.world == 1:
            return megatron_to_hf(local, self.model_cfg, layout)
        if pp == 1:  # what rank 0 lacks: the other ranks' experts and slices (whole weights are the same everywhere)
            names = [k for k in local if is_expert(k) or (tp > 1 and tp_partition(k, layout, self.model_cfg) is not None)]
            parts = gather_tensors(self._ranks, [local[k] for k in names])
            if self.rank != 0:
                return None
            states = [{**local, **{k: p[r] for k, p in zip(names, parts)}} for r in range(self.world)]
        else:  # stages hold different weights: each rank's whole state, serialised
            blobs = gather_bytes(self._ranks, b"" if self.rank == 0 else to_bytes(_cpu_state(local)), self.device)
            if self.rank != 0:
                return None
            states = [local] + [{k: v.to(self.device) for k, v in from_bytes(b).items()} for b in blobs[1:]]
        out: dict[str, torch.Tensor] = {}
        for stage in range(pp):
            for e in range(n):  # expert-parallel rank e of this stage: its tp ranks' slices merged
                merged = merge_tp([states[self._rank_at(t, e, stage)] for t in range(tp)], layout, self.model_cfg)
                if e > 0:
                    merged = {k: v for k, v in merged.items() if is_expert(k)}
                out.update(megatron_to_hf(merged, self.model_cfg, layout, ep_rank=e, ep_size=n, pp_rank=stage,
                                          pp_size=pp))
        return out

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The policy under its HF names (contiguous tensors on rank 0's device; with expert
        parallelism every rank's experts are gathered to rank 0)."""
        return {k: v.contiguous() for k, v in self._call("gather_hf", "policy").items()}

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The policy's parameters under their HF names, as the torch backend publishes them: buffers (GLM's
        ``e_score_correction_bias``, never trained) are in checkpoints (:meth:`hf_state`), not in the publish."""
        return self.published(self.hf_state())

    def hf_grads(self) -> dict[str, torch.Tensor]:
        """The policy's gradients under the HF names of :meth:`hf_weights` (gathered as :meth:`hf_state`; zeros for a
        parameter without one). Whole only after :meth:`step`'s clip has summed them over the ranks (read them then);
        for parity checks (``t1async bench megatron-parity``)."""
        return dict(self.published({k: v.contiguous() for k, v in self._call("gather_hf", "policy", True).items()}))

    @staticmethod
    def published(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The parameters of an HF state dict (:meth:`hf_state`): its buffers (``e_score_correction_bias``) left out."""
        return [(k, v) for k, v in state.items() if not k.endswith("e_score_correction_bias")]

    def critic_hf_state(self) -> dict[str, torch.Tensor]:
        """The critic under its HF names (``backbone.*``, ``head.*``), gathered as :meth:`hf_state`."""
        return {k: v.contiguous() for k, v in self._call("gather_hf", "critic").items()}

    def save(self, folder: Path) -> None:
        """One HF checkpoint (every rank's experts, slices and stages gathered): config.json +
        model.safetensors, critic.safetensors, optimizers.pt (rank 0's optimiser state) and, with
        N ranks, optimizers-rank{r}.pt for ranks r = 1..N-1 (rank 0 writes them all)."""
        state = {k: v.cpu() for k, v in self.hf_state().items()}
        masters = None
        if megatron_family(self.model_cfg) is None:
            save_hf(folder, self.model_cfg, state)
        else:  # the torch learner's checkpoint: model.path's layout (MTP layers carried through), else transformers'
            save_model(folder, self.model_cfg, state if self.model_cfg.path else checkpoint_state(self.model_cfg, state),
                       max_shard_bytes=self.cfg.checkpoint_shard_mb * 10**6)
            if checkpoint_rounds(self.model_cfg, state.values()):  # (a float32 learner of a bfloat16 folder)
                masters = dict(self.published(state))  # the exact parameters (as the torch learner keeps them)
        self._save_state(folder, self.critic_hf_state() if self.critic is not None else None, masters)
        if self.world > 1:
            self._call("save_optimizers", folder=folder)

    def _save_optimizers(self, folder: Path | None = None) -> None:
        blobs = gather_bytes(self._ranks, b"" if self.rank == 0 else to_bytes(self._optimizer_state()), self.device)
        for r in range(1, self.world) if self.rank == 0 else ():
            (folder / f"optimizers-rank{r}.pt").write_bytes(blobs[r])

    def _optimizer_state(self) -> dict:
        return {"policy": self.policy_opt.state_dict(),
                "critic": self.critic_opt.state_dict() if self.critic_opt is not None else None,
                "backend": self.name, **self.parallel_sizes(), "rank": self.rank}

    def _rank_file(self, folder: Path, r: int) -> bytes:
        """Rank r's saved optimiser state (``optimizers-ep{r}.pt``: written by expert-parallel runs
        before tensor and pipeline parallelism, where rank = expert-parallel rank)."""
        path = folder / f"optimizers-rank{r}.pt"
        old = folder / f"optimizers-ep{r}.pt"
        only_ep = self.tensor_parallel == self.pipeline_parallel == 1
        return (old if not path.exists() and old.exists() and only_ep else path).read_bytes()

    def load_state(self, folder: Path) -> bool:
        """Restore the critic, the policy's exact weights where the checkpoint's folder holds them rounded
        (``policy_masters``, written by :meth:`save`), and every rank's optimisers. Returns False (optimisers start fresh,
        logged) when the checkpoint's optimisers are another backend's or another parallel
        layout's (:meth:`parallel_sizes`), or a rank's file is missing."""
        saved = self._critic_file(folder)
        if saved is not None and self.critic is not None:
            self._call("load_hf", "critic", sd=saved)
        masters = torch.load(folder / "optimizers.pt", weights_only=True).get("policy_masters")
        if masters is not None:  # (save: the folder holds them rounded; either backend's: the same parameter names)
            now = self.hf_state()
            if masters.keys() != dict(self.published(now)).keys():
                raise ValueError(f"{folder}/optimizers.pt: its policy_masters do not match this policy's parameters; "
                                 "the checkpoint comes from another model")
            self._call("load_hf", "policy", sd={**now, **masters})
        blobs = None
        if self.world > 1:
            try:
                blobs = [b""] + [self._rank_file(folder, r) for r in range(1, self.world)]
            except FileNotFoundError as e:
                logger.warning("{}: {}: optimisers start fresh", folder, e)
        ok = self._load_optimizers(folder) if blobs is not None or self.world == 1 else False
        if not ok:
            logger.warning("{}: optimiser state of another backend or parallel layout (this run: megatron, {}): "
                           "optimisers start fresh", folder, self.parallel_sizes())
        if self.world > 1:
            self._call("load_rank_optimizers", ok, blobs=blobs if ok else None)
        return ok

    def _load_rank_optimizers(self, ok: bool, blobs: list[bytes] | None = None) -> None:
        """Every follower loads its optimiser state from rank 0's ``blobs`` (when ``ok``)."""
        if not ok:  # (every rank got the same ok)
            return
        data = scatter_bytes(self._ranks, blobs, self.device)
        if self.rank != 0:
            opt = from_bytes(data)
            saved = {k: opt.get(k, ONE_PROCESS[k]) for k in self.parallel_sizes()}
            if opt.get("rank") != self.rank or saved != self.parallel_sizes():
                raise RuntimeError(f"rank {self.rank}: its optimiser file holds rank {opt.get('rank')} of {saved}, "
                                   f"this run is {self.parallel_sizes()}")
            self.policy_opt.load_state_dict(opt["policy"])
            if self.critic_opt is not None and opt.get("critic") is not None:
                self.critic_opt.load_state_dict(opt["critic"])

    def _load_hf(self, role: str, sd: dict[str, torch.Tensor] | None = None) -> None:
        model, layout = (self.policy, POLICY) if role == "policy" else (self.critic, CRITIC)
        sd = self._share(None if sd is None else to_converter(self.model_cfg, sd))
        load_megatron(model, shard_tp(hf_to_megatron(sd, self.model_cfg, layout, ep_rank=self.dp_rank,
                                                     ep_size=self.expert_parallel, pp_rank=self.pp_rank,
                                                     pp_size=self.pipeline_parallel), layout, self.tp_rank,
                                      self.tensor_parallel, self.model_cfg))
        opt = getattr(self, "policy_opt" if role == "policy" else "critic_opt", None)
        if opt is not None:  # (a load after the optimisers were built: their float32 copies follow the weights)
            opt.sync_from_params()
