"""The learner with a real ZeroMQ socket, a real embedded sampler and a real gloo weight group."""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time

import numpy as np
import pytest
import torch

from t1async.actors.learner import Learner
from t1async.actors.sampler import EmbeddedSampler
from t1async.config import (
    AbnormalConfig,
    GenerationConfig,
    LearnerConfig,
    MegatronConfig,
    ModelConfig,
    SamplerConfig,
    TransportConfig,
    WeightSyncConfig,
)
from t1async.learner.abnormal import policy_mask
from t1async.models.logprobs import token_logprobs
from t1async.models.model import Qwen3MoeForCausalLM
from t1async.sampling.engine import Engine, SamplingParams
from t1async.trajectory import TURN_ABORTED, TURN_COMMAND_TIMEOUT, TURN_CUT_NOT_RUN, Trajectory
from t1async.transport.delivery import read_consumed
from t1async.transport.transport import ZmqSender
from tests.support.learner_fakes import MODEL, FakeController, send_trajectory, synthetic


def test_learner_trains_publishes_drops_stale_and_quarantines(tmp_path):
    sampler = EmbeddedSampler(MODEL, SamplerConfig(), seed=0)
    cfg = LearnerConfig(max_steps=2, batch_size=2, publish_every=1, max_staleness=0, batch_timeout_s=60, lr=1e-3)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(timeout_s=30), str(tmp_path), seed=0)
    try:
        assert learner.connect_samplers([sampler.url()]) == 0 and sampler.version == 0
        before = {n: p.detach().clone() for n, p in learner.policy.named_parameters()}
        tx = ZmqSender(learner.endpoint())
        tx.send("not-a-trajectory", b"\x93not a trajectory")
        send_trajectory(tx, synthetic(version=0, seed=1, reward=2.0))
        send_trajectory(tx, synthetic(version=0, seed=2, reward=0.0))
        result: dict = {}

        ctl = FakeController()
        th = threading.Thread(target=lambda: result.update(learner.run(ctl)))
        th.start()
        deadline = time.monotonic() + 60
        while learner.version < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert learner.version == 1
        send_trajectory(tx, synthetic(version=0, seed=3))  # now staleness 1 > 0: dropped and counted
        send_trajectory(tx, synthetic(version=1, seed=4, reward=2.0))
        send_trajectory(tx, synthetic(version=1, seed=5, reward=1.0))
        th.join(timeout=60)
        assert not th.is_alive()
        tx.close()

        rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [1, 2]
        for key in ("trajectories", "dropped_stale", "reward_mean", "resolved_rate", "staleness_max", "staleness_mean",
                    "logprob_diff_mean", "tokens_per_s", "queue_depth"):
            assert key in rows[0]
        assert rows[0]["reward_mean"] == 1.0 and rows[0]["resolved_rate"] == 0.5
        assert rows[1]["dropped_stale"] == 1 and rows[1]["dropped"]["stale"] == 1 and rows[1]["staleness_max"] == 0
        assert rows[0]["logprob_diff_mean"] > 0  # the synthetic behaviour log-probs are not the model's
        assert result["rejected"] == 1 and result["rejected_by"] == {"<frame>": 1}
        meta = json.loads((tmp_path / "quarantine" / "000001.json").read_text())
        assert meta["reason"] == "<frame>" and meta["key"] == "not-a-trajectory" and meta["source"] == "receipt"
        assert sampler.version == 2
        # the stale drop frees its admission slot; the rejected message does not (its sender does, see
        # test_rollout): a stranger's garbage must not widen admission
        assert ctl.versions == [1, 2] and [d.split(":")[0] for d in ctl.discarded] == ["stale"]
        assert torch.equal(sampler.engine.model.lm_head.weight, learner.policy.lm_head.weight)
        assert any(not torch.equal(before[n], p) for n, p in learner.policy.named_parameters())
        ckpt = tmp_path / "checkpoints" / "step_000002"
        loaded = Qwen3MoeForCausalLM.from_pretrained(ckpt)
        assert all(torch.equal(p, learner.policy.get_parameter(n)) for n, p in loaded.named_parameters())
        assert json.loads((ckpt / "trainer_state.json").read_text())["version"] == 2
    finally:
        learner.close()
        sampler.shutdown()


def test_critic_warmup_freezes_policy(tmp_path):
    cfg = LearnerConfig(max_steps=1, batch_size=1, critic_warmup_steps=1, lr_warmup_steps=4, batch_timeout_s=30)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)
    try:
        before = {n: p.detach().clone() for n, p in learner.policy.named_parameters()}
        critic_before = learner.critic.head.weight.detach().clone()
        metrics = learner.loop._train_step([synthetic(0, 1, reward=2.0)])
        assert metrics["train_policy"] is False and metrics["phase"] == "critic_warmup"
        assert metrics["value_loss"] > 0 and metrics["explained_variance"] is not None
        assert all(torch.equal(before[n], p) for n, p in learner.policy.named_parameters())
        assert not torch.equal(critic_before, learner.critic.head.weight)
        learner.loop.step = 1  # warm-up over: the next step updates the policy
        metrics = learner.loop._train_step([synthetic(0, 2, reward=1.0), synthetic(0, 3, reward=2.0)])
        assert metrics["phase"] == "rl"
        assert learner.policy_opt.param_groups[0]["lr"] == pytest.approx(cfg.lr / 4)  # first of 4 warm-up updates
        assert not all(torch.equal(before[n], p) for n, p in learner.policy.named_parameters())
    finally:
        learner.close()


def test_critic_is_the_policy_trunk_without_its_lm_head():
    from t1async.learner.torch_backend import ValueModel

    torch.manual_seed(0)
    policy = Qwen3MoeForCausalLM(MODEL)
    critic = ValueModel(policy)
    names = [n for n, _ in critic.named_parameters()]
    assert not any("lm_head" in n for n in names)
    trunk = dict(policy.model.named_parameters())
    assert all(torch.equal(p, trunk[n.removeprefix("backbone.")]) for n, p in critic.named_parameters()
               if n.startswith("backbone."))
    assert sum(p.numel() for p in critic.parameters()) == sum(p.numel() for p in policy.model.parameters()) + 33
    ids = torch.randint(0, MODEL.vocab_size, (2, 7))
    assert torch.equal(critic(ids), torch.zeros(2, 7))  # zero-initialised head: no value before training


def test_learner_scores_sampled_tokens_under_the_sampling_distribution(tmp_path):
    """Temperature 0.5, top-p 0.9, top-k 50: the learner's proximal log-probs of an engine's own
    output equal the engine's behaviour log-probs, so on-policy importance weights are 1."""
    gen = GenerationConfig(temperature=0.5, top_p=0.9, top_k=50)
    cfg = LearnerConfig(max_steps=1, batch_size=1, lr=1e-6, batch_timeout_s=30)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), generation=gen, seed=0)
    try:
        engine = Engine(copy.deepcopy(learner.policy).eval(), seed=3)
        prompt = [int(i) for i in np.random.default_rng(0).integers(4, 256, 9)]
        params = SamplingParams(max_new_tokens=24, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k)
        out = engine.generate(prompt, params)
        P, N = len(prompt), len(out.output_ids)
        T = P + N
        mask = np.r_[np.zeros(P, np.uint8), np.ones(N, np.uint8)]
        traj = Trajectory(
            task="on-policy", actor_id=0, token_ids=np.asarray(prompt + out.output_ids, np.uint32), loss_mask=mask,
            logprobs=np.r_[np.zeros(P), out.output_logprobs].astype(np.float32),
            versions=np.where(mask == 1, 0, -1).astype(np.int32), turn_offsets=np.array([[P, T]], np.int32),
            routed_experts=out.routed_experts.astype(np.uint8), num_experts=MODEL.num_experts, reward=1.0, passed=1,
            total=1, resolved=True, finish_reason="length", tests=[("a", True)])
        # the learner's scoring function on the learner's own logits, token by token
        ids = torch.tensor([prompt + out.output_ids])
        with torch.no_grad():
            logits = learner.policy(ids[:, :-1], routed_experts=torch.from_numpy(out.routed_experts).long()[None]).logits
        lp = token_logprobs(logits, ids[:, 1:], gen.temperature, gen.top_k, gen.top_p)[0, P - 1:]
        assert lp.dtype == torch.float32
        np.testing.assert_allclose(lp.numpy(), out.output_logprobs, rtol=0, atol=1e-4)
        plain = torch.log_softmax(logits[0, P - 1:].float(), -1).gather(1, ids[0, P:, None])[:, 0]
        assert float((plain - lp).abs().mean()) > 0.1  # the processing matters at this temperature
        # and the learner's whole update sees importance weights exp(prox - mu) of ~1
        m = learner.loop._train_step([traj])
        assert m["logprob_diff_mean"] < 1e-4
        assert abs(m["is_weight_mean"] - 1) < 1e-3 and abs(m["is_weight_max"] - 1) < 1e-3
        assert m["nucleus_boundary_tokens"] == 0 and m["kl_k3"] < 1e-6
    finally:
        learner.close()


def test_learner_refuses_greedy_generation(tmp_path):
    with pytest.raises(ValueError, match="generation.temperature=0.*temperature > 0"):
        Learner(LearnerConfig(), MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path),
                generation=GenerationConfig(temperature=0.0))


def abnormal(traj: Trajectory, status=None, **fields) -> Trajectory:
    """``traj`` with per-turn ``status`` codes and other fields set."""
    if status is not None:
        traj.turn_status = np.array(status, np.uint8)
    for k, v in fields.items():
        setattr(traj, k, v)
    return traj


def test_verifier_error_and_aborted_trajectories_are_never_trained_slots_returned_and_counted(tmp_path):
    cfg = LearnerConfig(max_steps=1, batch_size=2, publish_every=100, batch_timeout_s=60)  # default learner.abnormal
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)
    verifier = abnormal(synthetic(0, 1, reward=0.0), verifier_error="the verifier timed out after 60 s")
    aborted = abnormal(synthetic(0, 2), [0, TURN_ABORTED])
    cut = abnormal(synthetic(0, 3), [TURN_CUT_NOT_RUN, TURN_COMMAND_TIMEOUT])
    timeout = abnormal(synthetic(0, 4), finish_reason="timeout")
    try:
        tx = ZmqSender(learner.endpoint())
        for t in (verifier, aborted, cut, timeout):
            send_trajectory(tx, t)
        ctl = FakeController()
        learner.run(ctl)
        tx.close()
    finally:
        learner.close()
    assert [d.split(":")[0] for d in ctl.discarded] == ["verifier_error", "aborted"]  # both slots returned
    ckpt = tmp_path / "checkpoints" / "step_000001"
    ledger = read_consumed(ckpt / "consumed.json")  # a resume or a resend does not train them
    assert all(t.trajectory_id in ledger for t in (verifier, aborted, cut, timeout)) and len(ledger) == 4
    consumed = dict(ledger.recent)
    assert consumed == {verifier.trajectory_id: -1, aborted.trajectory_id: -1, cut.trajectory_id: 1,
                        timeout.trajectory_id: 1}
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["trajectories"] == 2 and row["dropped_stale"] == 0
    assert {k: v for k, v in row["dropped"].items() if v} == {"verifier_error": 1, "aborted": 1}
    assert row["abnormal_turns"] == {"length_cut": 0, "aborted": 0, "command_timeout": 1, "sandbox_refused": 0,
                                     "length_cut_not_run": 1}
    assert row["finish_reasons"] == {"max_turns": 1, "timeout": 1} and row["masked_turns"] == 0
    assert json.loads((ckpt / "trainer_state.json").read_text())["dropped"]["verifier_error"] == 1


def test_mask_turn_removes_exactly_that_turn_from_the_policy_loss_and_the_critic_still_trains_on_it(tmp_path):
    masking = AbnormalConfig(aborted="mask_turn")
    traj = abnormal(synthetic(0, 1, reward=2.0), [TURN_ABORTED, 0])  # turns [10, 20) and [28, 40)
    pm = policy_mask(traj, masking)
    expected = traj.loss_mask.copy()
    expected[10:20] = 0
    np.testing.assert_array_equal(pm, expected)
    assert traj.loss_mask[10:20].all()  # the trajectory's own mask is untouched
    # other behaviour log-probs on the masked turn only: no effect on the policy loss when masked
    other = abnormal(synthetic(0, 1, reward=2.0), [TURN_ABORTED, 0])
    other.logprobs = traj.logprobs.copy()
    other.logprobs[10:20] = -0.01
    losses = {}
    for action in ("mask_turn", "train"):
        cfg = LearnerConfig(batch_size=1, lr=0.0, critic_lr=0.0, abnormal=AbnormalConfig(aborted=action))
        learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / action), seed=0)
        try:  # lr 0: both steps see the same weights
            losses[action] = [learner.loop._train_step([t]) for t in (traj, other)]
        finally:
            learner.close()
    masked, trained = losses["mask_turn"], losses["train"]
    assert masked[0]["policy_loss"] == pytest.approx(masked[1]["policy_loss"], rel=1e-6, abs=1e-9)
    assert trained[0]["policy_loss"] != pytest.approx(trained[1]["policy_loss"], rel=1e-3)  # the control
    assert masked[0]["value_loss"] == pytest.approx(trained[0]["value_loss"], rel=1e-6)  # critic: every sampled token


def test_a_trajectory_whose_every_turn_is_masked_is_dropped_and_its_slot_returned(tmp_path):
    cfg = LearnerConfig(batch_size=1, batch_timeout_s=10, abnormal=AbnormalConfig(aborted="mask_turn"))
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)
    try:
        empty = abnormal(synthetic(0, 1), [TURN_ABORTED, TURN_ABORTED])
        half = abnormal(synthetic(0, 2), [TURN_ABORTED, 0])
        learner.loop._controller = ctl = FakeController()
        for t in (empty, half):
            learner.inbox.enqueue(t, 1)
        assert [t.trajectory_id for t in learner.loop._collect_batch()] == [half.trajectory_id]
        assert learner.dropped["all_turns_masked"] == 1 and learner.loop._consumed[empty.trajectory_id] == -1
        assert [d.split(":")[0] for d in ctl.discarded] == ["all_turns_masked"]
    finally:
        learner.close()


def test_kl_penalty_pulls_the_policy_back_to_the_reference(tmp_path):
    """With kl_coef > 0 and no advantage signal (every trajectory the same reward, so whitened
    advantages are 0), a step moves a perturbed policy toward the frozen warm start."""
    torch.manual_seed(0)  # the warm start's init: else it depends on the random numbers earlier tests drew
    ckpt = tmp_path / "warm"
    Qwen3MoeForCausalLM(MODEL).save_pretrained(ckpt)
    cfg = LearnerConfig(max_steps=1, batch_size=2, kl_coef=1.0, lr=1e-3, lam=1.0, init_checkpoint=str(ckpt),
                        batch_timeout_s=30)  # lam 1, equal rewards, zero critic: every advantage is 0
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / "run"), seed=0)
    try:
        with torch.no_grad():
            for p in learner.policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
        batch = [synthetic(0, 1, reward=1.0), synthetic(0, 2, reward=1.0)]

        def kl_to_reference() -> float:
            total = 0.0
            for t in batch:
                ids = torch.from_numpy(t.token_ids.astype(np.int64))[None]
                with torch.no_grad():
                    a = torch.log_softmax(learner.policy(ids).logits, -1)
                    b = torch.log_softmax(learner.reference(ids).logits, -1)
                total += float((a.exp() * (a - b)).sum(-1).mean())
            return total

        before = kl_to_reference()
        m = learner.loop._train_step(batch)
        assert m["kl_ref"] > 0
        assert kl_to_reference() < before
        assert all(not p.requires_grad for p in learner.reference.parameters())
    finally:
        learner.close()


def test_the_kl_penalty_s_gradient_through_a_learner_step_is_exactly_that_of_kl_to_the_reference(tmp_path, monkeypatch):
    """learner.kl_coef through a whole learner step, off-policy: one context, and one trajectory per
    vocabulary token x sampled after it by a uniform behaviour policy (log mu = -log 256), so the
    step's mean over loss tokens is the exact expectation over mu. With no advantage signal (one
    group, equal rewards), the step's policy gradient must equal kl_coef x the gradient of
    KL(pi_theta || pi_ref) at that context, computed exactly over the vocabulary (main's
    unweighted k3 gives another one)."""
    ckpt = tmp_path / "warm"
    Qwen3MoeForCausalLM(MODEL).save_pretrained(ckpt)
    cfg = LearnerConfig(max_steps=1, batch_size=MODEL.vocab_size, kl_coef=1.0, is_cap=1e9, init_checkpoint=str(ckpt),
                        advantage="group", critic=False, routing_replay=False, group_window_steps=0,
                        batch_timeout_s=30)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / "run"), seed=0)
    try:
        with torch.no_grad():
            for p in learner.policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
        ctx = [5, 17, 42]
        rng = np.random.default_rng(0)

        def traj(x: int) -> Trajectory:
            return Trajectory(
                task="one", actor_id=0, token_ids=np.array(ctx + [x], np.uint32), loss_mask=np.array([0, 0, 0, 1], np.uint8),
                logprobs=np.array([0, 0, 0, -np.log(MODEL.vocab_size)], np.float32),
                versions=np.array([-1, -1, -1, 0], np.int32), turn_offsets=np.array([[3, 4]], np.int32),
                routed_experts=rng.integers(0, 4, (3, 2, 2)).astype(np.uint8), num_experts=4, reward=1.0, passed=1,
                total=2, resolved=False, finish_reason="max_turns", tests=[("a", True), ("b", False)])

        batch = [traj(x) for x in range(MODEL.vocab_size)]
        named = [(n, p) for n, p in learner.policy.named_parameters() if p.requires_grad]
        got: dict[str, torch.Tensor] = {}
        real_step = learner.backend.step

        def step(**kw):
            got.update({n: p.grad.detach().clone() for n, p in named if p.grad is not None})
            return real_step(**kw)

        monkeypatch.setattr(learner.backend, "step", step)
        ids = torch.tensor([ctx])
        with torch.enable_grad():
            lp = torch.log_softmax(learner.policy(ids).logits[0, -1].float(), -1)
        with torch.no_grad():
            ref = torch.log_softmax(learner.reference(ids).logits[0, -1].float(), -1)
        kl = (lp.exp() * (lp - ref)).sum()
        want = torch.autograd.grad(kl, [p for _, p in named], allow_unused=True)
        learner.policy.zero_grad(set_to_none=True)
        m = learner.loop._train_step(batch)
        assert m["group_baselined_frac"] == 1.0
        flat_got = torch.cat([got.get(n, torch.zeros_like(p)).flatten() for n, p in named])
        flat_want = torch.cat([(w if w is not None else torch.zeros_like(p)).flatten() for (n, p), w in zip(named, want)])
        assert float(flat_want.norm()) > 0
        torch.testing.assert_close(flat_got, flat_want, rtol=1e-3, atol=1e-3 * float(flat_want.abs().max()))
        assert m["kl_ref"] == pytest.approx(float(kl.detach()), rel=1e-3)  # the importance-weighted k3 value
    finally:
        learner.close()


def test_a_restart_sends_the_last_published_version_again_unless_later_weights_were_lost(tmp_path):
    """A learner resumed at a checkpoint written right after a publication republishes that version
    unchanged (the samplers hold those very weights; a restart must not make everything in flight
    one version staler); when a later publication was lost with the process, it takes a new number."""
    sampler = EmbeddedSampler(MODEL, SamplerConfig(), seed=0)
    cfg = LearnerConfig(max_steps=2, batch_size=1, publish_every=1, checkpoint_every=1, batch_timeout_s=60)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(timeout_s=30), str(tmp_path), seed=0)
    try:
        learner.connect_samplers([sampler.url()])
        tx = ZmqSender(learner.endpoint())
        for seed in (1, 2):
            send_trajectory(tx, synthetic(version=0, seed=seed))
        assert learner.run(FakeController())["version"] == 2
        tx.close()
    finally:
        learner.close()
    resumed_cfg = dataclasses.replace(cfg, resume=True)
    for published, expected in ((2, 2), (3, 4)):
        (tmp_path / "receive_log" / "published_version").write_text(str(published))
        again = Learner(resumed_cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(timeout_s=30), str(tmp_path), seed=0)
        try:
            assert again.connect_samplers([sampler.url()]) == expected and sampler.version == expected
        finally:
            again.close()


def test_after_its_last_step_the_learner_stores_and_acks_what_arrives_and_a_resume_trains_it(tmp_path):
    """Trajectories that arrive after the learner's last step (rollout actors finishing their
    episodes while the run shuts down) are stored in the receive log and ACKed at once, not left
    unanswered: the sender's close returns without waiting out its flush timeout, nothing stays in
    its spool, and a resumed learner replays them from the log."""
    cfg = LearnerConfig(max_steps=1, batch_size=1, checkpoint_every=1, batch_timeout_s=60, publish_every=100)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)
    spool = tmp_path / "spool"
    try:
        tx = ZmqSender(learner.endpoint(), spool_dir=str(spool))
        send_trajectory(tx, synthetic(version=0, seed=1))
        assert learner.run(FakeController())["step"] == 1
        for seed in (2, 3, 4):  # after the last step: no training takes them
            send_trajectory(tx, synthetic(version=0, seed=seed))
        t0 = time.monotonic()
        tx.close(flush_timeout_s=20.0)
        closed_s = time.monotonic() - t0
        print(f"sender close after the learner's last step: {closed_s:.2f} s, acked {tx.stats.acked}")
        assert tx.stats.acked == 4 and closed_s < 10.0
        assert not [p for p in spool.rglob("*") if p.is_file() and p.stat().st_size > 0]
    finally:
        learner.close()
    again = Learner(dataclasses.replace(cfg, resume=True, max_steps=2), MODEL, TransportConfig(curve=False), WeightSyncConfig(),
                    str(tmp_path), seed=0)
    try:
        assert again.run(FakeController())["step"] == 2
        assert again.counters["replayed"] == 3  # the three stored after the last step, replayed from the log
    finally:
        again.close()


def assert_same_metrics(a: dict, b: dict) -> None:
    """Every float metric of ``a`` equals ``b``'s to 1e-5 relative (1e-6 absolute)."""
    for k, v in a.items():
        if isinstance(v, float):
            assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def weight_gap(w: dict, w2: dict, before: dict) -> tuple[float, float]:
    """(max over tensors of norm(w - w2) / norm(w), min over non-norm tensors of
    norm(w - before) / norm(before)): how far two updates' weights differ, and how far the smallest
    matrix moved."""
    rel = max(float((w[k] - w2[k]).norm() / w[k].norm()) for k in w)
    moved = min(float((w[k] - before[k]).norm() / before[k].norm()) for k in w if "norm" not in k)
    return rel, moved


def varied_batch() -> list[Trajectory]:
    """Five trajectories of 8 to 40 tokens (two tasks of two episodes, one lone), rewards 0-2."""
    batch = []
    for i, (T, reward, task) in enumerate([(17, 2.0, "a"), (40, 0.0, "a"), (29, 1.0, "b"), (8, 2.0, "b"), (23, 1.0, "c")]):
        t = synthetic(0, 10 + i, reward=reward, T=T)
        t.task = task
        batch.append(t)
    return batch


@pytest.mark.parametrize("advantage", ["gae", "group"])
def test_padded_micro_batches_train_like_one_trajectory_per_forward(tmp_path, advantage):
    """learner.micro_batch_tokens: five trajectories of different lengths in one right-padded
    forward give the metrics and, after two steps, the weights of one forward per trajectory (up to
    float summation order), under a filtered sampling distribution (top-p: padding's targets may lie
    outside it), routing replay, the critic's GAE or group advantages, and a KL penalty."""
    gen = GenerationConfig(temperature=0.7, top_p=0.9)
    out = {}
    for mbt in (0, 4096):
        cfg = LearnerConfig(batch_size=5, lr=1e-3, kl_coef=0.1, advantage=advantage, critic=advantage == "gae",
                            micro_batch_tokens=mbt)
        learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / str(mbt)),
                          generation=gen, seed=0)
        try:
            before = {k: v.detach().clone() for k, v in learner.backend.hf_weights()}
            forwards = []
            real = learner.backend.policy_logprobs
            learner.backend.policy_logprobs = (lambda inp, *a, _f=forwards, _real=real, **kw:
                                               _f.append(inp.shape) or _real(inp, *a, **kw))
            metrics = [learner.loop._train_step(varied_batch()) for _ in range(2)]
            out[mbt] = metrics, {k: v.detach().clone() for k, v in learner.backend.hf_weights()}, forwards
        finally:
            learner.close()
    (m1, w1, f1), (mb, wb, fb) = out[0], out[4096]
    assert [tuple(s) for s in f1[:5]] == [(1, 39), (1, 28), (1, 22), (1, 16), (1, 7)]
    assert [tuple(s) for s in fb] == [(5, 39), (5, 39)]  # one padded forward per step
    for a, b in zip(m1, mb):
        assert_same_metrics(a, b)
        assert a["routing_diff_frac"] == b["routing_diff_frac"] == 0.0 and a["router_diff_frac"] == b["router_diff_frac"]
        assert a["trained_tokens"] == b["trained_tokens"] and a["nucleus_boundary_tokens"] == b["nucleus_boundary_tokens"]
    rel, moved = weight_gap(w1, wb, before)
    # float summation order over two AdamW steps: 2.6e-5 measured on this 2-core machine (a
    # padding bug moves weights by the order of `moved`, about 6e-2)
    assert rel < 1e-4 and moved > 1e-3, (rel, moved)


def test_each_step_counts_the_micro_batches_it_trained_in_chunks(tmp_path):
    """``chunked_micro_batches``: how many micro-batches of the step were longer than
    ``learner.max_tokens_per_chunk`` (trained with the LM head in chunks and layers recomputed).
    The rule is per micro-batch: five trajectories of 39, 28, 22, 16 and 7 positions at a chunk
    size of 20 give 3 one per forward, 1 in one padded micro-batch (all five then run chunked),
    and 0 at the default of 4096."""
    got = {}
    for chunk, mbt in ((20, 0), (20, 4096), (4096, 4096)):
        cfg = LearnerConfig(batch_size=5, max_tokens_per_chunk=chunk, micro_batch_tokens=mbt)
        learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / f"{chunk}-{mbt}"), seed=0)
        try:
            got[chunk, mbt] = learner.loop._train_step(varied_batch())["chunked_micro_batches"]
        finally:
            learner.close()
    assert got == {(20, 0): 3, (20, 4096): 1, (4096, 4096): 0}


def test_micro_batches_group_longest_first_within_the_token_budget():
    from t1async.learner.rl import micro_batches

    lengths = [10, 40, 25, 40, 5, 100]
    # longest first: 100 alone; 2 x 40 (a third: 3 x 40 > 100); 25, 10, 5 padded to 3 x 25
    assert micro_batches(lengths, 100) == [[5], [1, 3], [2, 0, 4]]
    assert micro_batches(lengths, 0) == [[5], [1], [3], [2], [0], [4]]  # 0: each alone
    assert micro_batches([300, 7], 100) == [[0], [1]]  # longer than the budget: alone
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        micro_batches(lengths, -1)


@pytest.mark.parametrize("backend,ep", [("torch", 1), ("megatron", 2), ("megatron", 4)])
def test_micro_batch_spreads_padding_over_experts_and_expert_parallel_ranks(backend, ep):
    """Padded positions replay K distinct experts per row, each expert taking floor or ceil of the
    padding's assignments (per layer) and each expert-parallel rank likewise: no hot spot on
    experts 0..K-1 and rank 0. Real positions keep the sampler's rows."""
    from t1async.learner.rl import micro_batches
    from t1async.learner.update import micro_batch

    cfg = LearnerConfig(backend=backend, megatron=MegatronConfig(expert_parallel=ep))
    batch = varied_batch()
    E = 4  # varied_batch: 4 experts, top-2
    for group in micro_batches([t.num_tokens - 1 for t in batch], 4096):
        mb = micro_batch([batch[i] for i in group], torch.device("cpu"), cfg, E)
        rec, pad = mb["recorded"], ~mb["valid"]
        assert int(pad.sum()) >= 10  # lengths 8..40 in one micro-batch: plenty of padding
        rows = rec[pad]  # [n, L, K]
        assert (rows.sort(-1).values.diff(dim=-1) > 0).all()  # K distinct per row
        for layer in range(rows.shape[1]):
            per_expert = torch.bincount(rows[:, layer].flatten(), minlength=E)
            per_rank = per_expert.view(ep, E // ep).sum(1)
            assert int(per_expert.max() - per_expert.min()) <= 1, per_expert.tolist()
            assert int(per_rank.max() - per_rank.min()) <= 1, per_rank.tolist()
            assert float(per_rank.max() / per_rank.min()) < 1.1
        for b, i in enumerate(group):
            n = batch[i].num_tokens - 1
            assert torch.equal(rec[b, :n], torch.from_numpy(batch[i].routed_experts.astype(np.int64)))


def test_padding_routes_balance_experts_and_ranks_exactly_and_refuse_impossible_sizes():
    from t1async.learner.rl import padding_routes

    for n, K, E, P in [(1, 2, 4, 1), (7, 2, 8, 2), (13, 3, 8, 4), (5, 8, 8, 8), (9, 1, 6, 3), (0, 2, 4, 2)]:
        r = padding_routes(n, K, E, P)
        assert r.shape == (n, K) and r.dtype == torch.int64 and torch.equal(r, padding_routes(n, K, E, P))
        assert all(len(set(row)) == K for row in r.tolist())
        per_expert = torch.bincount(r.flatten(), minlength=E)
        per_rank = per_expert.view(P, E // P).sum(1)
        assert len(per_expert) == E and int(per_expert.max() - per_expert.min()) <= (1 if n else 0)
        assert int(per_rank.max() - per_rank.min()) <= (1 if n else 0)
    with pytest.raises(ValueError, match="top_k=5, num_experts=4"):
        padding_routes(3, 5, 4)
    with pytest.raises(ValueError, match="expert_parallel=3"):
        padding_routes(3, 2, 4, 3)


def test_bench_micro_batch_compares_both_on_one_batch_and_refuses_bad_counts(capsys):
    """t1async bench micro-batch: one JSON with each value's tokens/s and speedup over the first;
    the two learners took the same update (same loss); bad counts are one line, rc 2."""
    import json

    from t1async.cli import main

    for args in (["--warmup", "-1"], ["--micro-batch-tokens", "0,x"], ["--min-tokens", "50", "--max-tokens", "10"]):
        assert main(["bench", "micro-batch", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("t1async: error: bench micro-batch:") and err.count("\n") == 1, err
    assert main(["bench", "micro-batch", "--batch", "4", "--steps", "1", "--warmup", "0", "--min-tokens", "8",
                 "--max-tokens", "24"]) == 0
    doc = json.loads(capsys.readouterr().out)
    a, b = doc["results"]["0"], doc["results"]["4096"]
    assert a["speedup"] == 1.0 and b["speedup"] == pytest.approx(b["tokens_per_s"] / a["tokens_per_s"], rel=1e-2)
    assert b["policy_loss_last"] == pytest.approx(a["policy_loss_last"], rel=1e-4, abs=1e-7)
    assert a["padding_frac"] == 0.0 and 0.0 < b["padding_frac"] < 1.0  # one per forward: no padding at all
    # where the padding's replayed token slots go: spread (after) vs all on experts 0..K-1 (before)
    E, K = ModelConfig().num_experts, ModelConfig().num_experts_per_tok  # the bench's local model
    after, before = b["routing"]["after"], b["routing"]["before"]
    assert max(after["padding_expert_share"]) - min(after["padding_expert_share"]) <= 1.0 / E
    assert before["padding_expert_share"] == [1.0 / K] * K + [0.0] * (E - K)
    assert after["ep_rank_max_over_min"] < before["ep_rank_max_over_min"] and len(after["ep_rank_slot_ratio"]) == 2
    assert a["routing"]["after"] == a["routing"]["before"]  # no padding: nothing to spread
    assert main(["bench", "micro-batch", "--expert-parallel", "3"]) == 2
    assert "--expert-parallel 3 must divide" in capsys.readouterr().err


def test_policy_steps_raise_the_rewarded_trajectory_and_lower_the_unrewarded_one(tmp_path):
    """The direction of learning, end to end through the learner (GAE, whitening, decoupled PPO
    loss, optimiser): two trajectories sampled on-policy, one passing both tests (reward 2) and one
    none (reward 0). After a few steps the rewarded one's sampled tokens are more likely under the
    policy and the unrewarded one's less likely. A sign error anywhere on that path fails it."""
    cfg = LearnerConfig(max_steps=4, batch_size=2, lr=1e-3, lam=1.0, routing_replay=False, batch_timeout_s=30)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / "run"), seed=0)
    try:
        good, bad = synthetic(0, 1, reward=2.0), synthetic(0, 2, reward=0.0)

        def mean_logprob(t: Trajectory) -> float:
            ids = torch.from_numpy(t.token_ids.astype(np.int64))[None]
            with torch.no_grad():
                lp = torch.log_softmax(learner.policy(ids).logits[0, :-1].float(), -1)
            got = lp.gather(-1, ids[0, 1:, None])[:, 0]
            return float(got[torch.from_numpy(t.loss_mask[1:].astype(bool))].mean())

        for t in (good, bad):  # behaviour log-probs of the current policy: on-policy data
            ids = torch.from_numpy(t.token_ids.astype(np.int64))[None]
            with torch.no_grad():
                lp = torch.log_softmax(learner.policy(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            t.logprobs = np.concatenate([[0.0], np.where(t.loss_mask[1:] == 1, lp.numpy(), 0.0)]).astype(np.float32)
        before = (mean_logprob(good), mean_logprob(bad))
        for _ in range(4):
            learner.loop._train_step([good, bad])
        after = (mean_logprob(good), mean_logprob(bad))
        assert after[0] > before[0] + 0.05, (before, after)
        assert after[1] < before[1] - 0.05, (before, after)
    finally:
        learner.close()


def test_group_advantage_leaves_a_task_every_episode_resolves_untouched_and_moves_a_mixed_one(tmp_path):
    """advantage: group. Two episodes of one task with equal rewards have zero advantage, so the
    policy does not move (GAE, whose critic does not know the reward, would move it); two episodes
    of a task with rewards 2 and 0 get +1 and -1 and move it. A peer trained in the step before
    counts (group members split across batches)."""
    def make(advantage):
        cfg = LearnerConfig(max_steps=4, batch_size=2, lr=1e-3, lam=1.0, routing_replay=False, batch_timeout_s=30,
                            advantage=advantage, normalize_advantages=False)
        return Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / f"run-{advantage}"), seed=0)

    def params(learner):
        return torch.cat([p.detach().flatten().clone() for p in learner.policy.parameters()])

    group, gae_ = make("group"), make("gae")
    try:
        same = [synthetic(0, 1, reward=2.0), synthetic(0, 2, reward=2.0)]
        for learner in (group, gae_):
            before = params(learner)
            m = learner.loop._train_step(same)
            learner.loop.step += 1
            moved = float((params(learner) - before).abs().max())
            assert (moved == 0.0) == (learner is group), (learner.cfg.advantage, moved)
        assert "group_baselined_frac" not in m  # the gae learner's metrics
        mixed = synthetic(0, 3, reward=2.0)
        mixed.task = "other"
        before = params(group)
        m = group.loop._train_step([mixed])  # alone: no peer, falls back to GAE
        assert m["group_baselined_frac"] == 0.0
        group.loop.step += 1
        peer = synthetic(0, 4, reward=0.0)
        peer.task = "other"
        m = group.loop._train_step([peer, synthetic(0, 5, reward=2.0)])  # its peer came one step before
        assert m["group_baselined_frac"] == 1.0  # peer: "other" one step back; the synthetic: "synthetic" 2 steps back
        assert float((params(group) - before).abs().max()) > 0
    finally:
        group.close()
        gae_.close()


@pytest.mark.parametrize("advantage", ["group", "grpo"])
def test_whitening_leaves_a_group_that_scored_alike_at_exactly_zero_advantage_and_gradient(tmp_path, monkeypatch,
                                                                                          advantage):
    """learner.normalize_advantages on (the default) with a per-episode estimator, as
    configs/learning.yaml runs it. A task whose two episodes scored alike has advantage exactly 0
    on every token and adds exactly 0 to the policy gradient, although the other task's group
    (episodes of unequal length, so the batch's token mean advantage is not 0) has a signal; that
    group keeps its signs and is divided by the batch's std, not re-centred."""
    cfg = LearnerConfig(max_steps=4, batch_size=4, lr=1e-3, routing_replay=False, batch_timeout_s=30,
                        advantage=advantage, critic=False, micro_batch_tokens=0, group_window_steps=0)
    assert cfg.normalize_advantages
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / "run"), seed=0)
    from t1async.learner import update

    real = update.POLICY_LOSSES["ppo"]
    seen: list[tuple[int, torch.Tensor, torch.Tensor, float]] = []

    def spy(logp, logp_prox, logp_behavior, advantages, mask, **kw):
        out = real(logp, logp_prox, logp_behavior, advantages, mask, **kw)
        params = [p for p in learner.policy.parameters() if p.requires_grad]
        grads = torch.autograd.grad(out.loss, params, retain_graph=True, allow_unused=True)
        norm = sum(float(g.abs().sum()) for g in grads if g is not None)
        seen.append((logp.shape[1], advantages.detach().clone(), mask.clone(), norm))
        return out

    monkeypatch.setitem(update.POLICY_LOSSES, "ppo", spy)
    try:
        won, lost = synthetic(0, 1, reward=2.0, T=48), synthetic(0, 2, reward=0.0, T=40)
        same = [synthetic(0, 3, reward=1.0, T=32), synthetic(0, 4, reward=1.0, T=32)]
        won.task = lost.task = "mixed"
        for t in same:
            t.task = "same"
        m = learner.loop._train_step([won, lost, *same])
        assert m["group_baselined_frac"] == 1.0
        by_len = {}
        for positions, adv, mask, norm in seen:
            by_len.setdefault(positions, []).append((adv[mask.bool()], norm))
        assert sorted(len(v) for v in by_len.values()) == [1, 1, 2]
        for adv, norm in by_len[31]:  # the group that scored alike
            assert adv.numel() > 0 and bool((adv == 0).all()), adv
            assert norm == 0.0
        (a_won, n_won), = by_len[47]
        (a_lost, n_lost), = by_len[39]
        assert bool((a_won > 0).all()) and bool((a_lost < 0).all())  # signs kept
        assert n_won > 0 and n_lost > 0
        flat = torch.cat([a_won, a_lost, *(a for a, _ in by_len[31])])
        assert float(flat.std(unbiased=False)) == pytest.approx(1.0, rel=1e-5)  # scaled by the batch's std
    finally:
        learner.close()


def test_negative_advantage_weight_zero_trains_only_on_episodes_above_their_baseline(tmp_path):
    """learner.negative_advantage_weight. An episode that did worse than its task's peer (reward 0
    after a peer's 2, so advantage -2) moves the policy at weight 1 and leaves it exactly unchanged
    at weight 0; an episode that did better (reward 2 after a peer's 0) moves it at weight 0."""
    def params(learner):
        return torch.cat([p.detach().flatten().clone() for p in learner.policy.parameters()])

    def moved_by(weight: float, first: float, second: float) -> float:
        cfg = LearnerConfig(max_steps=4, batch_size=1, lr=1e-3, routing_replay=False, batch_timeout_s=30,
                            advantage="group", normalize_advantages=False, negative_advantage_weight=weight)
        learner = Learner(cfg, MODEL,
                          TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / f"run-{weight}-{first}"), seed=0)
        try:
            # the peer, as if trained one step before (a real earlier step would leave Adam momentum
            # that moves the weights even on a zero gradient)
            learner.loop._task_rewards = {synthetic(0, 1).task: [(learner.step, first)]}
            before = params(learner)
            m = learner.loop._train_step([synthetic(0, 2, reward=second)])
            assert m["group_baselined_frac"] == 1.0
            return float((params(learner) - before).abs().max())
        finally:
            learner.close()

    assert moved_by(1.0, 2.0, 0.0) > 0
    assert moved_by(0.0, 2.0, 0.0) == 0.0
    assert moved_by(0.0, 0.0, 2.0) > 0


def test_critic_off_builds_no_critic_and_baselines_a_lone_episode_on_the_batch(tmp_path):
    """learner.critic=false (advantage: group). No critic is built (no weights, optimiser or
    checkpoint file), the policy still learns from a mixed group, a trajectory without a peer of
    its task is baselined on the mean reward of the rest of the batch (so two lone episodes of
    equal reward give no gradient), and the metrics carry no critic figures. A run resumed from
    that checkpoint with the critic on starts its critic afresh."""
    cfg = LearnerConfig(max_steps=4, batch_size=2, lr=1e-3, routing_replay=False, batch_timeout_s=30,
                        advantage="group", normalize_advantages=False, critic=False)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / "run"), seed=0)

    def params(module):
        return torch.cat([p.detach().flatten().clone() for p in module.parameters()])

    try:
        assert learner.critic is None and learner.critic_opt is None
        policy0 = params(learner.policy)
        lone = [synthetic(0, 1, reward=2.0), synthetic(0, 2, reward=2.0)]
        lone[0].task, lone[1].task = "a", "b"
        m = learner.loop._train_step(lone)
        assert m["group_baselined_frac"] == 0.0
        assert float((params(learner.policy) - policy0).abs().max()) == 0.0
        assert "value_loss" not in m and "explained_variance" not in m
        learner.loop.step += 1
        mixed = [synthetic(0, 3, reward=2.0), synthetic(0, 4, reward=0.0)]
        learner.loop._train_step(mixed)
        assert float((params(learner.policy) - policy0).abs().max()) > 0
        learner.loop.step += 1
        learner.save_checkpoint()
        saved = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
        assert (saved / "model.safetensors").exists() and not (saved / "critic.safetensors").exists()
    finally:
        learner.close()
    on = dataclasses.replace(cfg, critic=True, advantage="gae", resume=True)
    learner = Learner(on, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / "run"), seed=0)
    try:
        assert learner.step == 2 and learner.critic is not None
        assert torch.equal(params(learner.policy), params(Qwen3MoeForCausalLM.from_pretrained(saved)))
    finally:
        learner.close()


def test_critic_off_is_refused_where_the_critic_is_needed():
    from t1async.config import ConfigError, check_trainable, load_config

    with pytest.raises(ConfigError, match="learner.critic=false needs learner.advantage=group"):
        check_trainable(load_config(None, ["learner.critic=false"]))
    with pytest.raises(ConfigError, match="critic_warmup_steps"):
        check_trainable(load_config(None, ["learner.critic=false", "learner.advantage=group",
                                           "learner.critic_warmup_steps=5"]))
    check_trainable(load_config(None, ["learner.critic=false", "learner.advantage=group"]))


def test_a_resumed_learner_keeps_the_group_advantage_window(tmp_path):
    """advantage: group. The recent rewards per task go into the checkpoint, so a group split by a
    restart still finds its peers: the resumed learner baselines the rest of the group on them
    instead of falling back."""
    cfg = LearnerConfig(max_steps=4, batch_size=1, routing_replay=False, batch_timeout_s=30, advantage="group")
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)
    try:
        learner.loop._train_step([synthetic(0, 1, reward=2.0)])
        learner.loop.step += 1
        window = copy.deepcopy(learner.loop._task_rewards)
        learner.save_checkpoint()
    finally:
        learner.close()
    assert window == {"synthetic": [(1, 2.0)]}
    again = Learner(dataclasses.replace(cfg, resume=True), MODEL,
                    TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)
    try:
        assert again.loop._task_rewards == window
        assert again.loop._train_step([synthetic(0, 2, reward=0.0)])["group_baselined_frac"] == 1.0
    finally:
        again.close()


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["learner_wait", "learner_version"])
def test_learner_wait_holds_the_publish_for_a_slow_episode_instead_of_dropping_it(tmp_path, rule):
    """Batch 1, bound 1, the real controller. A slow episode S starts at version 0 beside fast
    ones. After F1 trains (version 1), F2 is ready but publishing version 2 would leave S, still
    running, two versions stale. ``learner_wait``: the learner holds, then trains S first (oldest
    first) and F2 after, nothing dropped. ``learner_version`` (AReaL's rule): it publishes and
    drops S as stale when it arrives."""
    from t1async.actors.controller import Controller
    from t1async.config import RolloutConfig

    ctl = Controller(RolloutConfig(num_actors=0, admission=rule), ["t"], rollouts_per_version=1, max_staleness=1,
                     make_rollout=None, seed=0)
    cfg = LearnerConfig(max_steps=3, batch_size=1, publish_every=1, max_staleness=1,
                        batch_timeout_s=60, lr=1e-3)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(timeout_s=30), str(tmp_path), seed=0)
    sampler = EmbeddedSampler(MODEL, SamplerConfig(), seed=0)
    slow, f1, f2 = synthetic(0, 1), synthetic(0, 2), synthetic(1, 3)
    try:
        assert learner.connect_samplers([sampler.url()]) == 0
        tx = ZmqSender(learner.endpoint())
        assert ctl.acquire(0) == "t" and ctl.acquire(1) == "t"  # S (actor 0) and F1 (actor 1) at version 0
        ctl.episode_finished(1, f1.trajectory_id)
        send_trajectory(tx, f1)
        th = threading.Thread(target=learner.run, args=(ctl,))
        th.start()
        deadline = time.monotonic() + 60
        while ctl.ledger.version < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert learner.version == 1 and ctl.ledger.version == 1
        assert ctl.acquire(1) == "t"  # F2 at version 1: admission follows the learner under both rules
        ctl.episode_finished(1, f2.trajectory_id)
        send_trajectory(tx, f2)
        time.sleep(2.0)
        if rule == "learner_wait":
            assert learner.version == 1 and learner.step == 1  # held: S would be 2 versions stale
            assert ctl.publish_allowed(2, [f2.trajectory_id]) is False
        else:
            assert learner.version == 2  # AReaL's rule ran ahead
        ctl.episode_finished(0, slow.trajectory_id)
        send_trajectory(tx, slow)
        if rule == "learner_version":  # the third step trains F3; S is dropped on the way
            f3 = synthetic(2, 4)
            assert ctl.acquire(1) == "t"
            ctl.episode_finished(1, f3.trajectory_id)
            send_trajectory(tx, f3)
        th.join(timeout=60)
        assert not th.is_alive()
        tx.close()
        rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        if rule == "learner_wait":
            assert learner.loop._consumed[slow.trajectory_id] == 2 and learner.loop._consumed[f2.trajectory_id] == 3
            assert rows[-1]["dropped_stale"] == 0 and [r["staleness_max"] for r in rows] == [0, 1, 1]
            assert rows[1]["hold_s"] >= 1.5 and rows[0]["hold_s"] == 0
        else:
            assert learner.dropped["stale"] == 1 and learner.loop._consumed[slow.trajectory_id] == -1
            deadline = time.monotonic() + 10
            while ctl.ledger.discarded < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ctl.ledger.discarded == 1  # its slot returned
    finally:
        learner.close()
        sampler.shutdown()


def test_a_bfloat16_resume_with_fresh_optimisers_keeps_the_checkpoints_critic(tmp_path):
    """The torch learner in bfloat16 resuming a checkpoint whose optimiser state it cannot take (another backend's):
    the critic it loads after building its optimisers survives the next step (learning rate 0 for the policy, zero
    gradients for the critic: no move) bit for bit; the float32 masters used to keep the critic of before the load and
    the step rounded them back into it."""
    from t1async.learner.torch_backend import TorchBackend

    cfg = LearnerConfig()
    torch.manual_seed(0)
    first = TorchBackend(cfg, MODEL, GenerationConfig(), dtype=torch.bfloat16)
    with torch.no_grad():
        for p in first.critic.parameters():
            p.add_(0.5)
    first.save(tmp_path / "ckpt")
    opt = torch.load(tmp_path / "ckpt" / "optimizers.pt", weights_only=True)
    torch.save({**opt, "backend": "megatron"}, tmp_path / "ckpt" / "optimizers.pt")
    torch.manual_seed(1)
    second = TorchBackend(cfg, MODEL, GenerationConfig(), tmp_path / "ckpt", dtype=torch.bfloat16)
    assert second.load_state(tmp_path / "ckpt") is False  # another backend's optimisers: fresh ones
    want = {k: v.detach().clone() for k, v in first.critic.named_parameters()}
    assert all(torch.equal(p, want[k]) for k, p in second.critic.named_parameters())
    second.zero_grad()
    second.step(policy=True, policy_lr=0.0)
    assert all(torch.equal(p, want[k]) for k, p in second.critic.named_parameters())


def test_16_bit_parameters_are_stepped_through_float32_master_weights():
    """bfloat16 parameters under AdamW at an RL learning rate: plain AdamW on them loses almost
    every update to rounding (the bug this optimiser fixes); MasterWeightAdamW's float32 masters
    take the float32 AdamW steps (same gradients: the same values to float32 rounding), the
    bfloat16 parameters are their masters rounded, and a state-dict round trip restores the
    masters bitwise. float32 parameters are stepped in place with AdamW's own state dict."""
    from t1async.learner.backend import MasterWeightAdamW

    torch.manual_seed(0)
    w = torch.randn(64, 64) * 0.05
    grads = [torch.randn(64, 64) for _ in range(20)]

    def run(param, opt, n=20):
        for g in grads[:n]:
            opt.zero_grad()
            param.grad = g.to(param.dtype)
            opt.step()

    ref = torch.nn.Parameter(w.clone())
    run(ref, torch.optim.AdamW([ref], lr=1e-5, weight_decay=0.0))
    plain = torch.nn.Parameter(w.bfloat16())
    run(plain, torch.optim.AdamW([plain], lr=1e-5, weight_decay=0.0))
    lost = float((plain == w.bfloat16()).float().mean())
    mixed = torch.nn.Parameter(w.bfloat16())
    opt = MasterWeightAdamW([mixed], lr=1e-5, weight_decay=0.0)
    master_start = opt.masters[0].clone()
    run(mixed, opt)
    master = opt.masters[0]
    moved = (ref - w).abs()
    gap = float(((master - master_start) - (ref - w)).abs().max())
    print(f"bf16, 20 AdamW steps at lr 1e-5: plain AdamW left {lost:.1%} of the elements unchanged; the masters' "
          f"moves differ from float32 AdamW's by at most {gap:.2e}, the mean move being {float(moved.mean()):.2e}")
    assert lost > 0.5  # the failure: most bfloat16 weights never move
    assert torch.equal(master_start, w.bfloat16().float())  # masters start at the parameters' values
    assert gap < 0.05 * float(moved.mean())  # float32 AdamW's steps (from the rounded start; gradients in bf16)
    assert torch.equal(mixed.detach(), master.bfloat16())
    sd = opt.state_dict()
    again = torch.nn.Parameter(mixed.detach().clone())
    opt2 = MasterWeightAdamW([again], lr=1e-5, weight_decay=0.0)
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.masters[0], master) and torch.equal(opt2.state[opt2.masters[0]]["exp_avg"],
                                                                  opt.state[master]["exp_avg"])
    with pytest.raises(ValueError, match="master weights do not match"):
        MasterWeightAdamW([torch.nn.Parameter(torch.zeros(3).bfloat16())], lr=1e-5, weight_decay=0.0).load_state_dict(sd)
    f32 = torch.nn.Parameter(w.clone())
    o32 = MasterWeightAdamW([f32], lr=1e-5, weight_decay=0.0)
    run(f32, o32)
    assert torch.equal(f32.detach(), ref.detach()) and o32.masters[0] is f32 and "master_weights" not in o32.state_dict()
    plain_sd = torch.optim.AdamW([torch.nn.Parameter(w.clone())], lr=1e-5).state_dict()
    o32.load_state_dict(plain_sd)  # an AdamW file (older checkpoints) loads as it is


def test_a_bfloat16_learner_moves_its_weights_at_rl_learning_rates():
    """The torch backend in bfloat16 at lr 1e-6: after 5 updates its float32 masters have moved
    about as many elements as float32 training moves (both above 80 %); the same backend with
    plain AdamW stepping its bfloat16 weights (as before MasterWeightAdamW) moves under 10 %."""
    from t1async.config import GenerationConfig
    from t1async.learner.torch_backend import TorchBackend

    model = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=24)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    frac = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16 masters", torch.bfloat16),
                        ("bfloat16 plain AdamW", torch.bfloat16)):
        torch.manual_seed(0)
        b = TorchBackend(LearnerConfig(lr=1e-6), model, GenerationConfig(), dtype=dtype)
        if name.endswith("plain AdamW"):
            b.policy_opt = torch.optim.AdamW(b.policy.parameters(), lr=1e-6, weight_decay=b.cfg.weight_decay)
        weights = list(b.policy_opt.masters) if hasattr(b.policy_opt, "masters") else list(b.policy.parameters())
        start = [w.detach().clone() for w in weights]
        for _ in range(5):
            b.zero_grad()
            b.policy_logprobs(ids[:, :-1], ids[:, 1:], None, grad=True, routing=False).logp.sum().backward()
            b.step(policy=True, policy_lr=1e-6)
        frac[name] = sum(int((w != s).sum()) for w, s in zip(weights, start)) / sum(s.numel() for s in start)
        if name == "bfloat16 masters":
            assert all(torch.equal(p.detach(), m.to(dtype)) for p, m in zip(b.policy.parameters(), weights))
    print("elements of the policy moved by 5 updates at lr 1e-6: " + ", ".join(f"{k} {v:.1%}" for k, v in frac.items()))
    assert frac["float32"] > 0.8 and frac["bfloat16 masters"] > 0.8 and frac["bfloat16 plain AdamW"] < 0.1


def test_grpo_advantage_leaves_an_all_alike_group_untouched_and_moves_a_mixed_one(tmp_path):
    """advantage: grpo (t1async/learner/advantages.py), through the learner: equal rewards give
    advantage 0 (the policy does not move), rewards 2 and 0 move it; both groups are covered."""
    cfg = LearnerConfig(max_steps=4, batch_size=2, lr=1e-3, lam=1.0, routing_replay=False, batch_timeout_s=30,
                        advantage="grpo", normalize_advantages=False, group_window_steps=0)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / "run"), seed=0)

    def params():
        return torch.cat([p.detach().flatten().clone() for p in learner.policy.parameters()])

    try:
        before = params()
        m = learner.loop._train_step([synthetic(0, 1, reward=2.0), synthetic(0, 2, reward=2.0)])
        assert float((params() - before).abs().max()) == 0.0 and m["group_baselined_frac"] == 1.0
        learner.loop.step += 1
        m = learner.loop._train_step([synthetic(0, 3, reward=2.0), synthetic(0, 4, reward=0.0)])
        assert float((params() - before).abs().max()) > 0 and m["group_baselined_frac"] == 1.0
    finally:
        learner.close()
