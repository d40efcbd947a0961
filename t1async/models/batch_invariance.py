"""Row padding that makes a matmul's result for one row independent of the rows beside it.

The embedded engine packs the new tokens of several sequences into one row block (continuous batching), so a
token's projections run in matmuls of varying row counts M. CPU BLAS picks its kernel and its thread split
by M: on the machines measured (torch 2.13 CPU, MKL 2024.2, float32) a row's result differed in the last bit
between M = 1-3 and larger M with one thread, and at every M = 1-11 that is not a multiple of 4 with two
threads; at M a multiple of 4 and at least 4 it was bitwise the same whatever the batch. An AVX-512 Xeon
measured earlier needed up to 12 rows. Zero rows appended up to a row count where the result is the same
for every M (and cut off again) give a token bitwise the logits and routing of the same token decoded
alone (tests/unit/models/test_batching.py).

How many rows are enough depends on the machine, the shape, the dtype and the thread count, so it is not a
constant: :func:`min_rows` finds it once per (in, out, dtype, device, threads) by a probe. A probe runs the
same matmul on random rows at every candidate count (multiples of :data:`ROW_MULTIPLE` from 4 to 64, then
128) and compares each row bitwise with the same rows inside a 256-row matmul; the answer is the
smallest count from which every probed count agrees. Decode (one real row) then pads to that count instead
of a fixed 16, which is where the embedded engine spends most of its decode time (``python
tools/bench_model_speed.py --profile``).

Sound only as far as the probe reaches: the kernel choice depends on shapes, never on values, so random
rows stand for every input; row counts above 256 are assumed to behave as 256 does (as the fixed 16 rows
before assumed of every count above the ones measured).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn

__all__ = ["ROW_MULTIPLE", "Linear", "column_major_parameters", "column_major_view", "is_column_major", "min_rows",
           "padded_rows", "probe_rows", "rows_for", "to_column_major"]

ROW_MULTIPLE = 4
"""Padded row counts are multiples of this (the BLAS' thread split treats such counts alike)."""
PROBE_ROWS = (*range(ROW_MULTIPLE, 65, ROW_MULTIPLE), 128)
"""Row counts a probe tries, smallest first."""
PROBE_REFERENCE_ROWS = 256
"""Rows of the matmul every probed count is compared with."""
FALLBACK_ROWS = 64
"""Rows used where no probed count from 64 down is invariant (logged once as a warning)."""

_found: dict[tuple, int] = {}
_lock = threading.Lock()


def probe_rows(fn, width: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """The smallest row count from which ``fn`` treats every row alike, found by running it.

    Args:
        fn: maps rows ``[M, width]`` (dtype, device) to ``[M, ...]``, row-wise in exact arithmetic
            (a matmul, an elementwise op).
        width: the rows' last dim.

    Returns:
        the smallest P in :data:`PROBE_ROWS` such that for every probed count M >= P each output row is bitwise
        the same row of a :data:`PROBE_REFERENCE_ROWS`-row call, or :data:`FALLBACK_ROWS` when no such P < 64.
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_REFERENCE_ROWS, width, generator=g).to(dtype=dtype, device=device)
    with torch.no_grad():
        ref = fn(x)
        ok = [torch.equal(fn(x[:m].clone()), ref[:m]) for m in PROBE_ROWS]
    for i, m in enumerate(PROBE_ROWS):
        if all(ok[i:]):
            return min(m, FALLBACK_ROWS)
    return FALLBACK_ROWS


def min_rows(in_features: int, out_features: int, dtype: torch.dtype, device: torch.device,
             silu: bool = False, column_major: bool = False) -> int:
    """Rows a ``[M, in] x [in, out]`` matmul needs to be batch invariant here (with ``silu``: and the SiLU of its
    ``[M, out]`` result too), probed on first use for this shape, dtype, device, weight layout (``column_major``:
    a weight ``[out, in]`` stored as the transpose of a contiguous ``[in, out]``, see :func:`to_column_major`) and
    torch thread count, and cached for the process. Thread-safe.

    Callers with at least :data:`FALLBACK_ROWS` rows need no answer (every probed count is below), so only small
    batches (decode, an expert's few tokens) ever start a probe; it costs about one matmul of 1,000 rows.
    """
    key = (in_features, out_features, dtype, device.type, torch.get_num_threads(), silu, column_major)
    rows = _found.get(key)
    if rows is None:
        with _lock:
            rows = _found.get(key)
            if rows is None:
                g = torch.Generator().manual_seed(1)
                shape = (in_features, out_features) if column_major else (out_features, in_features)
                w = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
                w = w.mT if column_major else w
                rows = probe_rows(lambda r: F.linear(r, w), in_features, dtype, device)
                if silu:
                    rows = max(rows, probe_rows(F.silu, out_features, dtype, device))
                what = (f"[M, {in_features}] x [{in_features}, {out_features}] {dtype}{' + SiLU' if silu else ''}"
                        f"{' (column-major weight)' if column_major else ''}")
                if rows == FALLBACK_ROWS:
                    logger.warning("no row count below {} keeps a {} matmul batch invariant on this machine ({} "
                                   "threads); padding to {} rows, a batched token may differ from a lone one in "
                                   "the last bit", FALLBACK_ROWS, what, key[4], rows)
                else:
                    logger.debug("batch invariant from {} rows: {}, {} threads", rows, what, key[4])
                _found[key] = rows
    return rows


def rows_for(x: torch.Tensor, weight: torch.Tensor, silu: bool = False) -> int:
    """:func:`min_rows` for rows ``x [..., in]`` times ``weight [out, in]`` (x's dtype and device, the weight's
    layout), or 0 (nothing to probe) when x has :data:`FALLBACK_ROWS` rows or more."""
    if x.numel() >= FALLBACK_ROWS * x.shape[-1]:
        return 0
    return min_rows(weight.shape[1], weight.shape[0], x.dtype, x.device, silu, is_column_major(weight))


def is_column_major(t: torch.Tensor) -> bool:
    """Whether ``t [..., out, in]`` is stored as the transpose of a contiguous ``[..., in, out]`` (and is not also
    contiguous itself, as a one-column matrix is)."""
    if t.dim() < 2:
        return False
    out, inn = t.shape[-2:]
    return out > 1 and inn > 1 and t.stride(-2) == 1 and t.stride(-1) == out and (t.dim() == 2 or t.stride(-3) == out * inn)


def column_major_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of ``model`` that :func:`to_column_major` stores transposed, by ``named_parameters`` name:
    every :class:`Linear`'s weight (a tied LM head's under its embedding's name) and the parameters a module
    lists in its ``column_major`` attribute (fused experts' 3D weights)."""
    ids = set()
    for m in model.modules():
        if isinstance(m, Linear):
            ids.add(id(m.weight))
        ids.update(id(getattr(m, n)) for n in getattr(m, "column_major", ()))
    return {n: p for n, p in model.named_parameters() if id(p) in ids and p.dim() >= 2}


def to_column_major(model: nn.Module) -> int:
    """Store each of :func:`column_major_parameters` as the transpose of a contiguous tensor (shape, values, names and
    identity unchanged; ``.data`` replaced), for decoding: a matmul of a few rows reads such a weight without the
    transposing copy MKL makes of a row-major one. Returns how many were moved (those already column-major are
    left)."""
    moved = 0
    with torch.no_grad():
        for p in column_major_parameters(model).values():
            if p.mT.is_contiguous():
                continue
            p.data = p.data.mT.contiguous().mT
            moved += 1
    return moved


def column_major_view(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A ``shape`` ``[..., out, in]`` view of the contiguous buffer ``flat`` (as many elements) laid out column-major,
    so that ``view.copy_(t)`` writes ``t`` transposed into it (a receive buffer for a :func:`to_column_major` model).
    """
    *lead, out, inn = shape
    return flat.view(*lead, inn, out).mT


def padded_rows(x: torch.Tensor, rows_min: int) -> tuple[torch.Tensor, int]:
    """``x [..., D]`` flattened to ``[P, D]`` rows with zero rows appended, P = ``max(rows_min, M rounded up to a
    multiple of ROW_MULTIPLE)``, and M, the rows that are real (the first M)."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    pad = max(rows_min - m, -m % ROW_MULTIPLE)
    rows = x.reshape(m, x.shape[-1])
    return (F.pad(rows, (0, 0, 0, pad)) if pad else rows), m


class Linear(nn.Linear):
    """``nn.Linear`` whose result for one row never depends on the other rows of the batch.

    The input's leading dims are flattened to M rows and zero rows are appended up to :func:`min_rows` for
    this layer's shape (at least M rounded up to a multiple of :data:`ROW_MULTIPLE`), then cut off again.
    Same parameters and state_dict names as ``nn.Linear``; gradients flow as usual (the padding rows get none).
    """

    def min_rows(self, x: torch.Tensor, silu: bool = False) -> int:
        """Rows this layer pads an input like ``x`` to at least (:func:`rows_for`)."""
        return rows_for(x, self.weight, silu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if m >= FALLBACK_ROWS and not m % ROW_MULTIPLE:  # nothing to pad, nothing to probe
            return F.linear(x, self.weight, self.bias)
        rows, m = padded_rows(x, self.min_rows(x))
        if rows.shape[0] == m:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(rows, self.weight, self.bias)
        return y[:m].reshape(*x.shape[:-1], y.shape[-1])
