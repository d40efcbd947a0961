"""Task formats and verifier semantics of published corpora, on the minimal synthetic tasks of
tests/fixtures/corpus/ (issue 41 items 2-5): what the harness would score, the episode scores."""

from __future__ import annotations

from pathlib import Path

from t1async.envs.taskio.loading import load_task
from t1async.envs.terminal import TerminalEnv

CORPUS = Path(__file__).parent / "fixtures" / "corpus"


def test_a_verifier_timeout_is_the_agents_failure_trained_as_reward_0(tmp_path):
    """Item 5: the tests wait for what the agent never made; the harness stops them at
    ``[verifier] timeout_sec`` and scores a failure. The episode gets reward 0 and no
    ``verifier_error`` (so the learner trains it); the oracle, which makes it, resolves."""
    task = load_task(CORPUS / "verifier-hangs")
    with TerminalEnv(task, root=tmp_path) as env:
        env.reset()
        hung = env.verify()
        assert hung.timed_out and hung.error is None
        assert (hung.passed, hung.total, hung.reward, hung.resolved) == (0, 1, 0.0, False)
        assert 2.5 < hung.seconds < 20
        env.reset()
        env.run_solution()
        done = env.verify()
    assert done.resolved and not done.timed_out and done.reward == 1.0
