"""tools/send_trajectory.py, the operator's way to see intake from outside (docs/operations.md)."""

from __future__ import annotations

import numpy as np

from t1async.config import load_config
from t1async.transport.intake import RunFacts, check_trajectory
from tests.support.tools import load_tool


def test_the_sent_trajectory_is_stamped_with_the_version_it_is_given_and_passes_intake_but_for_length():
    """A fresh operator's trajectory stamped version 0 was dropped as stale in a run at version 7
    (and counted as ``stale_restart`` after a resume): the tool now stamps the learner's version."""
    tool = load_tool("send_trajectory")
    model = load_config(None).model
    t = tool.trajectory(model, 300, "send-1", version=7)
    sampled = t.loss_mask == 1
    assert sampled.any() and set(np.unique(t.versions[sampled]).tolist()) == {7}
    assert set(np.unique(t.versions[~sampled]).tolist()) == {-1}
    facts = RunFacts(model.vocab_size, model.num_experts, model.num_hidden_layers, model.num_experts_per_tok,
                     max_tokens=300)
    check_trajectory(t, facts, max_version=7)  # consistent (raises otherwise): only its length can be wrong
