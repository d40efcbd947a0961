"""Several processes for the ``megatron`` learner backend: tensor, pipeline and expert parallelism (SPMD).

With ``learner.megatron.tensor_parallel: T``, ``pipeline_parallel: S`` and ``expert_parallel: P``
(N = T x S x P > 1) the learner's backend is rank 0 of N. It starts ranks 1..N-1 as Ray actors
(:class:`Follower`; on CUDA each asks Ray for one GPU, on CPU for no CPU so they fit a 2-core
Ray), and the N processes form one ``torch.distributed`` world (nccl on CUDA, gloo on CPU)
through a ``tcp://`` rendezvous on a free port of rank 0's host (rank 0 hosts the TCPStore), with
Megatron's model-parallel groups ``(T, S, expert_parallel=P)``: on each of S pipeline stages, P
data-parallel groups of T ranks, each group forwarding its share of every micro-batch's rows.

Every backend call on rank 0 is announced to the followers on a gloo control group (the default
group on CPU, a gloo group beside the nccl one on CUDA: a follower waiting for its next call then
sleeps in a socket read instead of spinning a GPU kernel), with its arguments (small CPU objects,
pickled): the same for every rank, or one part per rank scattered after the announcement (a
forward's token ids and replay rows: each follower receives only its own rows). Every rank then
runs the same code on its arguments. Outputs, output gradients, weights, gradients and optimiser
state move on the default group (:func:`gather_tensors`, :func:`scatter_flat`, :func:`all_reduce_`,
:func:`share_state`, :func:`gather_bytes`, ...).

Failures: rank 0 checks its followers' Ray calls before each announcement and after any failed
collective, and raises :class:`RankFailed` naming the rank and its error. Rank 0's collectives
time out after ``learner.megatron.timeout_s`` (a follower alive but stuck; those inside Megatron's
forward after that many whole minutes, at least one: Megatron's groups take minutes), the
rendezvous after the larger of it and :data:`STARTUP_S`; the followers' own timeout is a year
(they wait for rank 0's next call however long the learner waits for data).
A follower whose call fails tears its process group down, so rank 0's collectives fail at once.
Followers are Ray actors owned by the learner: they die with it, and :meth:`RankGroup.close`
stops and kills them.
"""

from __future__ import annotations

import datetime
import io
import os
import re
import socket
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

__all__ = ["FOLLOWER_TIMEOUT", "STARTUP_S", "Follower", "RankFailed", "RankGroup", "expert_owner", "leave_world"]

FOLLOWER_TIMEOUT = datetime.timedelta(days=365)  # a follower waits for rank 0's next call this long
STARTUP_S = 120.0  # the least time rank 0 gives its followers' processes to start and say they join
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")  # HF expert names (policy model.*, critic backbone.*)


class RankFailed(RuntimeError):
    """A follower rank died, failed, or did not answer within ``learner.megatron.timeout_s``."""


def expert_owner(name: str, num_experts: int, world: int) -> int | None:
    """The rank holding HF weight ``name`` under expert parallelism ``world``: the owner of its
    expert (global expert e lives on rank e // (num_experts / world)), or None (every rank)."""
    m = _EXPERT.search(name)
    return None if m is None else int(m.group(1)) // (num_experts // world)


def _cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it (nested lists, tuples, dicts) moved to the CPU, detached."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj


class RankGroup:
    """One rank's membership of the world of the megatron learner ranks (tensor x pipeline x
    expert parallel).

    Rank 0 (:meth:`start`) owns the followers' Ray handles and the refs of their
    :meth:`Follower.serve` calls; a follower's (:meth:`join`) has none.

    Attributes:
        rank, world: this process's rank and the world size N.
        device: where this rank computes (``cuda`` on a follower is its one Ray-assigned GPU).
        control: the gloo group that carries announcements.
        timeout_s: rank 0's bound on rendezvous and collectives.
    """

    def __init__(self, rank: int, world: int, device: torch.device, control: Any, timeout_s: float,
                 handles: list[Any] | None = None, refs: list[Any] | None = None):
        self.rank, self.world, self.device, self.control = rank, world, device, control
        self.timeout_s = timeout_s
        self.handles, self.refs = handles or [], refs or []
        self.failed: str | None = None  # set once: every later call raises it again

    # ---- rendezvous -----------------------------------------------------------------------
    @classmethod
    def start(cls, world: int, device: torch.device, timeout_s: float, follower_args: dict[str, Any], *,
              tensor_parallel: int = 1, pipeline_parallel: int = 1) -> RankGroup:
        """Rank 0: start ranks 1..world-1 as Ray actors and form the world with them.

        Args:
            world: N > 1. device: rank 0's device (its type picks nccl or gloo and the followers'
                GPU request). timeout_s: the bound on the rendezvous.
            follower_args: keyword arguments of :meth:`Follower.serve` besides the rendezvous.
            tensor_parallel, pipeline_parallel: Megatron's tensor- and pipeline-parallel sizes T and S
                (T x S divides N; expert parallel = data parallel = N / (T x S)).

        Raises:
            RuntimeError: Ray is not initialised (``t1async launch`` initialises it; tests and
                benches call ``ray.init``). RankFailed: a follower failed or did not join in time.
        """
        import ray  # (ray: deferred; only expert_parallel > 1 starts ranks)

        if not ray.is_initialized():
            raise RuntimeError("learner.megatron.expert_parallel > 1 starts its follower ranks as Ray actors: "
                               "call ray.init() first (t1async launch does)")
        leave_world()
        host = ray.util.get_node_ip_address()
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, 0, world, True, timeout, wait_for_workers=False)
        cuda = device.type == "cuda"
        actor = ray.remote(num_cpus=0, num_gpus=1 if cuda else 0, max_restarts=0)(Follower)
        handles = [actor.options(name=None).remote() for _ in range(1, world)]
        refs = [h.serve.remote(rank=r, world=world, host=host, port=store.port, tensor_parallel=tensor_parallel,
                               pipeline_parallel=pipeline_parallel, **follower_args)
                for r, h in zip(range(1, world), handles)]
        group = cls(0, world, device, None, timeout_s, handles, refs)
        group._store = store
        startup_s = max(timeout_s, STARTUP_S)  # (a Ray worker to start, torch and megatron to import, a GPU)
        deadline = time.monotonic() + startup_s
        waiting = list(range(1, world))
        while waiting:  # each follower says it is about to join; a follower that fails is named at once
            group.check()
            if time.monotonic() > deadline:
                group.kill()
                raise RankFailed(f"megatron learner ranks {waiting} did not join rank 0 at "
                                 f"{host}:{store.port} within {startup_s:g} s (the larger of "
                                 f"learner.megatron.timeout_s and {STARTUP_S:g} s)")
            if store.check([f"joining/{waiting[0]}"]):
                waiting.pop(0)
            else:
                time.sleep(0.2)
        if cuda:  # NCCL needs one GPU per rank; Ray does not know the GPU the learner (rank 0) uses
            gpus = [_gpu_id(device)] + [store.get(f"gpu/{r}").decode() for r in range(1, world)]
            twice = [r for r in range(1, world) if gpus[r] in gpus[:r]]
            if twice:
                group.kill()
                raise RankFailed(f"megatron learner ranks {twice} were given a GPU another rank uses "
                                 f"({gpus}); NCCL needs one GPU per rank. Ray does not reserve the learner's GPU "
                                 "(rank 0): let rank 0 use a GPU Ray does not hand out (learner.megatron.device=cuda:K "
                                 "with K outside the GPUs Ray schedules) or give Ray more GPUs than it hands out")
        try:
            group.control = _init_world(0, world, device, store, timeout, tensor_parallel, pipeline_parallel)
        except Exception as e:
            group.check(wait_s=5.0)
            group.kill()
            raise RankFailed(f"megatron learner ranks: rendezvous failed: {e}") from e
        logger.info("megatron ranks: {} (tensor parallel {}, pipeline parallel {}, expert parallel {}; {}, "
                    "rendezvous {}:{})", world, tensor_parallel, pipeline_parallel,
                    world // (tensor_parallel * pipeline_parallel), "nccl" if cuda else "gloo", host, store.port)
        return group

    @classmethod
    def join(cls, rank: int, world: int, host: str, port: int, device: torch.device, *,
             tensor_parallel: int = 1, pipeline_parallel: int = 1) -> RankGroup:
        """A follower: join rank 0's world (see :meth:`start`)."""
        import megatron.core.parallel_state  # noqa: F401  (imported before saying it joins: it takes seconds)

        store = dist.TCPStore(host, port, world, False, datetime.timedelta(seconds=600))
        store.set(f"where/{rank}", f"{socket.gethostname()} pid {os.getpid()}")
        store.set(f"gpu/{rank}", _gpu_id(device))
        store.set(f"joining/{rank}", "1")
        group = cls(rank, world, device, _init_world(rank, world, device, store, FOLLOWER_TIMEOUT, tensor_parallel,
                                                     pipeline_parallel), 0.0)
        group._store = store
        return group

    # ---- announcements --------------------------------------------------------------------
    def announce(self, op: str, args: tuple, parts: list[tuple] | None = None) -> None:
        """Rank 0: send (op, args) to every follower (tensors go as CPU copies); with ``parts``
        (one argument tuple per rank, ``parts[0]`` rank 0's own), follower r gets ``parts[r]``
        instead of ``args``, sent to it alone (a scatter after the announcement)."""
        dist.broadcast_object_list([(op, _cpu(args), parts is not None)], src=0, group=self.control)
        if parts is not None:
            if len(parts) != self.world:
                raise ValueError(f"announce({op!r}): {len(parts)} argument parts for {self.world} ranks")
            dist.scatter_object_list([None], [None] + [_cpu(p) for p in parts[1:]], src=0, group=self.control)

    def receive(self) -> tuple[str, tuple]:
        """A follower: wait (up to a year) for rank 0's next (op, args); ``args`` is this rank's
        own part when rank 0 sent one per rank."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        op, args, split = box[0]
        if split:
            mine: list[Any] = [None]
            dist.scatter_object_list(mine, None, src=0, group=self.control)
            args = mine[0]
        return op, args

    def check(self, wait_s: float = 0.0) -> None:
        """Rank 0: raise :class:`RankFailed` naming every follower whose Ray call has ended (it
        died, failed, or returned); waits up to ``wait_s`` for one to end."""
        import ray  # (ray: deferred, as in start)

        if self.failed:
            raise RankFailed(self.failed)
        if not self.refs:
            return
        done, _ = ray.wait(self.refs, num_returns=1, timeout=wait_s)
        if not done:
            return
        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0.5)
        why = []
        for r, ref in enumerate(self.refs, start=1):
            if ref in done:
                try:
                    ray.get(ref)
                    why.append(f"rank {r} ({self.where(r)}) stopped serving")
                except Exception as e:  # RayActorError (died), RayTaskError (its call raised)
                    why.append(f"rank {r} ({self.where(r)}) failed: {str(e).strip().splitlines()[-1][:300]}")
        self.failed = "megatron learner ranks: " + "; ".join(why)
        raise RankFailed(self.failed)

    def where(self, rank: int) -> str:
        """Rank 0: ``"HOST pid PID"`` of follower ``rank`` (as it said when joining), or ``"?"``."""
        try:
            return self._store.get(f"where/{rank}").decode() if self._store.check([f"where/{rank}"]) else "?"
        except Exception:  # (the store is rank 0's own; this only guards a torn-down one)
            return "?"

    def run(self, fn: Callable[[], Any]) -> Any:
        """Rank 0: ``fn()`` (an announced call's local part), with a failed collective turned into
        :class:`RankFailed` naming the follower behind it (or the timeout when none ended)."""
        try:
            return fn()
        except RankFailed:
            raise
        except Exception as e:
            if not _is_comm_error(e):
                raise
            self.check(wait_s=10.0)  # a follower that died: named
            self.failed = (f"megatron learner ranks: call failed on rank 0 while every follower still runs (a "
                           f"follower stuck longer than learner.megatron.timeout_s={self.timeout_s:g} s, or an "
                           f"error on rank 0; the ranks are out of step and the backend must be rebuilt): {e}")
            raise RankFailed(self.failed) from e

    # ---- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        """Rank 0: tell the followers to stop, wait briefly, kill them, and leave the world."""
        import ray  # (ray: deferred, as in start)

        if self.refs and not self.failed:
            try:
                self.announce("close", ())
                ray.wait(self.refs, num_returns=len(self.refs), timeout=10)
            except Exception as e:  # a dead follower: killed below anyway
                logger.warning("megatron learner ranks: close: {}", e)
        self.kill()
        leave_world()

    def kill(self) -> None:
        """Rank 0: kill every follower actor (no restart)."""
        import ray  # (ray: deferred, as in start)

        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # already gone
                pass
        self.handles, self.refs = [], []


def _gpu_id(device: torch.device) -> str:
    """The physical identity (UUID) of CUDA ``device``; ``"cpu"`` for the CPU."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def _is_comm_error(e: BaseException) -> bool:
    return isinstance(e, (RuntimeError, dist.DistError, ConnectionError, OSError))


def leave_world() -> None:
    """Destroy Megatron's groups and the default group of this process, if any."""
    from megatron.core import parallel_state  # (megatron: deferred to the first collective)

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _init_world(rank: int, world: int, device: torch.device, store: Any, timeout: datetime.timedelta,
                tensor_parallel: int = 1, pipeline_parallel: int = 1) -> Any:
    """The default group (nccl on CUDA, gloo on CPU), the gloo control group, Megatron's groups
    (tensor parallel T, pipeline parallel S, expert parallel = data parallel P = world / (T S);
    Megatron's rank order puts TP innermost and PP outermost: rank = tp_rank + T dp_rank
    + T P pp_rank). Returns the control group. Every rank calls it in the same order."""
    from megatron.core import parallel_state  # (megatron: deferred, as above)

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("t1async-ep", store), rank=rank,
                            world_size=world, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
    minutes = max(1, int(timeout.total_seconds() // 60))
    parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel,
                                             expert_model_parallel_size=world // (tensor_parallel * pipeline_parallel),
                                             distributed_timeout_minutes=minutes)
    return control


# ---- collectives every rank calls in the same order ---------------------------------------------
def share_state(group: RankGroup, sd: dict[str, torch.Tensor] | None, keep: Callable[[str], bool],
                device: torch.device) -> dict[str, torch.Tensor]:
    """Rank 0's state dict ``sd`` on every rank, each keeping only the names ``keep`` accepts.

    Names, shapes and dtypes go on the control group, then each tensor is broadcast on the
    default group (on ``device``); a follower holds one tensor it does not keep at a time.

    Returns:
        ``{name: tensor on device}`` for the kept names (rank 0: its own tensors, moved).
    """
    meta = [[(k, tuple(v.shape), v.dtype) for k, v in sd.items()] if group.rank == 0 else None]
    dist.broadcast_object_list(meta, src=0, group=group.control)
    out = {}
    for name, shape, dtype in meta[0]:
        t = sd[name].to(device).contiguous() if group.rank == 0 else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0)
        if keep(name):
            out[name] = t
    return out


def all_reduce_(tensors: list[torch.Tensor], group: Any = None) -> None:
    """Replace each of ``tensors`` (same names, shapes and dtypes on every rank of ``group``, the
    world by default, in the same order) by its sum over those ranks, in place: one flat buffer
    and one all-reduce per dtype (16-bit floats summed in float32, then rounded back). An
    all-reduce leaves the same bits on every rank (each element's sum is computed once and
    passed on, by gloo and NCCL alike), so replicas summed this way cannot drift apart."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        ts = by_dtype[dtype]
        flat = torch.cat([t.reshape(-1) for t in ts])
        if dtype.is_floating_point and dtype.itemsize < 4:
            flat = flat.float()  # bf16 / fp16 gradients summed in float32 (each rank's part rounded once, not per step)
        dist.all_reduce(flat, group=group)
        for t, part in zip(ts, flat.split([t.numel() for t in ts])):
            t.copy_(part.view_as(t))


def scatter_flat(group: RankGroup, parts: list[torch.Tensor] | None, numel: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """Rank r receives rank 0's 1-D ``parts[r]`` (``parts`` given on rank 0 only, one per rank,
    each ``numel`` long, of ``dtype``); returns it on ``device``."""
    buf = torch.empty(numel, dtype=dtype, device=device)
    dist.scatter(buf, [p.to(device, dtype).contiguous() for p in parts] if group.rank == 0 else None, src=0)
    return buf


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """The sums over ranks of ``values`` (float64, one all-reduce)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def gather_tensors(group: RankGroup, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]] | None:
    """Rank 0: for each tensor (same shape on every rank), its value on every rank, in rank
    order; followers: None."""
    out: list[list[torch.Tensor]] = []
    for t in tensors:
        t = t.detach().contiguous()
        parts = [torch.empty_like(t) for _ in range(group.world)] if group.rank == 0 else None
        dist.gather(t, parts, dst=0)
        if group.rank == 0:
            out.append(parts)
    return out if group.rank == 0 else None


def gather_bytes(group: RankGroup, data: bytes, device: torch.device) -> list[bytes] | None:
    """Rank 0: every rank's ``data`` in rank order; followers: None."""
    sizes = gather_tensors(group, [torch.tensor([len(data)], dtype=torch.int64, device=device)])
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    buf = torch.zeros(int(n), dtype=torch.uint8, device=device)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else buf[:0]
    parts = gather_tensors(group, [buf])
    if group.rank != 0:
        return None
    return [bytes(p[:int(s)].cpu().numpy()) for p, s in zip(parts[0], sizes[0])]


def scatter_bytes(group: RankGroup, data: list[bytes] | None, device: torch.device) -> bytes:
    """Rank r receives rank 0's ``data[r]`` (``data`` given on rank 0 only, one per rank)."""
    sizes = torch.tensor([len(d) for d in data] if group.rank == 0 else [0] * group.world, dtype=torch.int64,
                         device=device)
    dist.broadcast(sizes, src=0)
    n = int(sizes.max())
    buf = torch.zeros(n, dtype=torch.uint8, device=device)
    chunks = None
    if group.rank == 0:
        chunks = []
        for d in data:
            c = torch.zeros(n, dtype=torch.uint8, device=device)
            if d:
                c[:len(d)] = torch.frombuffer(bytearray(d), dtype=torch.uint8).to(device)
            chunks.append(c)
    dist.scatter(buf, chunks, src=0)
    return bytes(buf[:int(sizes[group.rank])].cpu().numpy())


def to_bytes(obj: Any) -> bytes:
    """``torch.save`` of ``obj`` into memory."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> Any:
    """Inverse of :func:`to_bytes` (``weights_only``: tensors, numbers, containers)."""
    return torch.load(io.BytesIO(data), weights_only=True)


class Follower:
    """A follower rank's Ray actor: one long :meth:`serve` call runs rank 0's announced backend calls."""

    def serve(self, *, rank: int, world: int, host: str, port: int, tensor_parallel: int, pipeline_parallel: int,
              cfg: Any, model_cfg: Any, generation: Any, semantics: Any, device: str, dtype: torch.dtype,
              threads: int, backend: Any, ops: frozenset[str]) -> int:
        """Join rank 0's world, build this rank's part of the backend (weights from rank 0), then
        run each announced call until ``close``. Returns ``rank``.

        ``backend`` is the backend's class (``MegatronBackend``, passed by rank 0 so that this
        module does not import the backend that imports it) and ``ops`` the calls a follower
        runs (each ``backend._<op>``).

        Raises:
            whatever a call raised (after leaving the world, so rank 0's collectives fail at once).
        """
        warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))

        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        group = RankGroup.join(rank, world, host, port, dev, tensor_parallel=tensor_parallel,
                               pipeline_parallel=pipeline_parallel)
        try:
            impl = backend(cfg, model_cfg, generation, device=dev, dtype=dtype, ranks=group, semantics=semantics)
            while True:
                op, args = group.receive()
                if op == "close":
                    return rank
                if op not in ops:
                    raise RuntimeError(f"rank {rank}: unknown call {op!r}")
                getattr(impl, "_" + op)(*args)
        finally:
            leave_world()
