"""The row-padding probe (t1async/models/batch_invariance.py): it finds the row count from which a matmul treats
every row alike on this machine, a Linear padded to it gives one row the same bits in any batch, and the engine's
column-major layout keeps values, names and the model's answers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import t1async.models.batch_invariance as bi
from t1async.config import ModelConfig
from t1async.models.batch_invariance import (
    FALLBACK_ROWS,
    PROBE_ROWS,
    Linear,
    column_major_parameters,
    column_major_view,
    is_column_major,
    min_rows,
    probe_rows,
    to_column_major,
)
from t1async.models.model import Qwen3MoeForCausalLM

CFG = ModelConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, tie_word_embeddings=True)


def _varies_below(n: int):
    """A row-wise op whose rows change in the last bit when it runs on fewer than n rows."""
    return lambda r: r * 3.0 if r.shape[0] >= n else r * 3.0 + r.abs() * 1e-7


def test_the_probe_answers_the_smallest_count_from_which_every_probed_count_agrees():
    assert probe_rows(_varies_below(12), 8, torch.float32) == 12
    assert probe_rows(_varies_below(1), 8, torch.float32) == PROBE_ROWS[0]
    # a count that agrees below one that does not is not an answer: every count from the answer up must agree
    assert probe_rows(lambda r: r * 3.0 if r.shape[0] not in (20, 24) else r * 3.0 + 1e-3, 8, torch.float32) == 28


def test_an_op_never_invariant_falls_back_and_says_so(monkeypatch):
    assert probe_rows(lambda r: r + r.shape[0] * 1e-3, 8, torch.float32) == FALLBACK_ROWS
    monkeypatch.setattr(bi, "probe_rows", lambda *a, **k: FALLBACK_ROWS)
    monkeypatch.setattr(bi, "_found", {})
    seen = []
    handler = bi.logger.add(seen.append, level="WARNING")
    try:
        assert min_rows(7, 5, torch.float32, torch.device("cpu")) == FALLBACK_ROWS
    finally:
        bi.logger.remove(handler)
    assert len(seen) == 1 and "batch invariant" in seen[0] and "[M, 7] x [7, 5]" in seen[0]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("column_major", [False, True])
def test_one_row_gets_the_same_bits_alone_and_in_any_batch(threads, column_major):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        lin = Linear(64, 48, bias=False)
        if column_major:
            lin.weight.data = lin.weight.data.mT.contiguous().mT
        assert is_column_major(lin.weight) == column_major
        x = torch.randn(300, 64)
        with torch.no_grad():
            big = lin(x)
            for m in (1, 2, 3, 5, 7, 9, 11, 13, 37, 63, 65, 130):
                assert torch.equal(lin(x[:m]), big[:m]), m
        # the real matmul rows themselves: from the probed count up (multiples of 4) they agree with 300 rows
        r = min_rows(64, 48, torch.float32, torch.device("cpu"), column_major=column_major)
        assert r in PROBE_ROWS and r <= FALLBACK_ROWS
        ref = F.linear(x, lin.weight)
        for m in range(r, 257, 4):
            assert torch.equal(F.linear(x[:m], lin.weight), ref[:m]), m
    finally:
        torch.set_num_threads(old)


def test_column_major_keeps_values_names_ties_and_answers():
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(CFG).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, CFG.vocab_size, (2, 17))
    with torch.no_grad():
        ref = model(ids).logits
    moved = to_column_major(model)
    names = column_major_parameters(model)
    assert moved == len(names) > 0 and "model.embed_tokens.weight" in names  # the tied LM head
    assert "lm_head.weight" not in names  # tied: one parameter, its embedding's name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(is_column_major(p) for p in names.values())
    assert not any(is_column_major(p) for n, p in model.named_parameters() if n not in names)  # norms
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        got = model(ids).logits
    assert (got - ref).abs().max().item() <= 1e-5
    assert to_column_major(model) == 0  # already laid out
    twin = copy.deepcopy(model)  # a copy keeps the layout
    assert all(is_column_major(p) for p in column_major_parameters(twin).values())


def test_a_column_major_receive_view_takes_a_tensor_transposed():
    t = torch.arange(24.0).reshape(2, 3, 4)
    flat = torch.empty(24)
    v = column_major_view(flat, (2, 3, 4))
    v.copy_(t)
    assert torch.equal(v, t) and is_column_major(v) and v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(flat.view(2, 4, 3), t.mT)
