"""Config sections of the learner side: abnormal ends, Megatron, the learner, the mismatch measurement, SFT."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from t1async.config.rules import Choice, Section, choice, rule


class AdvantageName(Choice):
    """``learner.advantage``: the keys of ``t1async.learner.advantages.ADVANTAGES`` (see ``LearnerConfig.advantage``)."""

    gae = "gae"
    """The critic, GAE over sampled tokens"""
    group = "group"
    """Leave-one-out over a task's episodes"""
    grpo = "grpo"
    """Group mean and standard deviation"""


class PolicyLossName(Choice):
    """``learner.policy_loss``: the keys of ``t1async.learner.losses.POLICY_LOSSES``."""

    ppo = "ppo"
    """Decoupled PPO with a truncated importance weight"""


ADVANTAGE_NAMES = AdvantageName.values()
"""Values of ``learner.advantage``."""
POLICY_LOSS_NAMES = PolicyLossName.values()
"""Values of ``learner.policy_loss``."""


class Reward(Choice):
    """``learner.reward``: the episode reward."""

    dense = "dense"
    """The number of verifier tests passed"""
    binary = "binary"
    """1 when resolved, else 0"""


class LearnerBackendName(Choice):
    """``learner.backend``: the training engine."""

    torch = "torch"
    """Plain PyTorch"""
    megatron = "megatron"
    """megatron-core (``pip install 't1async[megatron]'``)"""


class TrainDtype(Choice):
    """``learner.megatron.dtype`` and ``mismatch.learner_dtype``: parameter and compute dtype."""

    float32 = "float32"
    bfloat16 = "bfloat16"


class Dispatcher(Choice):
    """``learner.megatron.dispatcher``: the MoE token dispatcher."""

    auto = "auto"
    """alltoall on CUDA, allgather on CPU"""
    allgather = "allgather"
    alltoall = "alltoall"
    """CUDA only"""


class AbnormalAction(Choice):
    """``learner.abnormal.*``: what the learner does with one kind of abnormal end."""

    train = "train"
    """As if nothing happened"""
    mask_turn = "mask_turn"
    """Per-turn kinds only: the turn's sampled tokens leave the policy loss"""
    drop = "drop"
    """The whole trajectory is never trained on"""


_TURN_ACTION = choice(AbnormalAction, "'train', 'mask_turn' or 'drop'")
_EPISODE_ACTION = rule(lambda v: v in ("train", "drop"), "'train' or 'drop' (an episode-level end has no one turn to mask)")



@dataclass
class AbnormalConfig(Section):
    """What the learner does with a trajectory that did not end normally, one field per kind.

    Each kind is recorded by the rollout actor: per turn in ``Trajectory.turn_status``, per
    episode in ``finish_reason``. Values: ``train`` (as if nothing happened: the outcome is a
    consequence of the policy's own choice and the reward is real), ``mask_turn`` (per-turn kinds
    only: the sampled tokens of each such turn leave the policy loss; the critic still trains on
    them, see t1async/learner/update.py), ``drop`` (the whole trajectory is never trained on: its
    admission slot is returned, its id marked consumed, and it is counted by kind in
    metrics.jsonl ``dropped``). A trajectory whose every loss token is masked is dropped
    (``dropped["all_turns_masked"]``).

    A verifier error (``Trajectory.verifier_error`` set: timeout, crash, no test summary) is
    always dropped and not configurable: its reward is unknown, the 0 it carries is not a real
    score, and since the reward reaches every token through GAE there is no part of the episode
    that could be trained safely (``dropped["verifier_error"]``).
    """

    length_cut: AbnormalAction = field(default=AbnormalAction.train, metadata=_TURN_ACTION)
    """A turn cut at ``generation.max_new_tokens`` (run or not, see ``env.run_cut_commands``).
    Default train: the policy sampled every one of those tokens itself, and running out of tokens
    (with the observation saying so) is what teaches it to answer briefly."""
    aborted: AbnormalAction = field(default=AbnormalAction.drop, metadata=_TURN_ACTION)
    """A turn the sampler aborted (SGLang finish_reason ``abort``; the command was not run).
    Default drop: the turn was ended by the serving system, not by the policy, so the rest of the
    episode and its reward are shaped by an event the policy cannot learn to avoid."""
    command_timeout: AbnormalAction = field(default=AbnormalAction.train, metadata=_TURN_ACTION)
    """A turn whose command overran ``env.command_timeout_s`` and was killed. Default train: a
    hanging command is the policy's choice, and the timeout note it saw is its consequence."""
    sandbox_refused: AbnormalAction = field(default=AbnormalAction.train, metadata=_TURN_ACTION)
    """A turn whose command hit a sandbox limit (processes, memory, disk). Default train: as for a
    timeout, the limit is part of the environment the policy acts in."""
    tool_call_error: AbnormalAction = field(default=AbnormalAction.train, metadata=_TURN_ACTION)
    """A turn whose tool call was malformed (``env.action_format`` tool_call; it was not run and
    the agent saw an error observation). Default train: the malformed call is the policy's own
    output and the error it saw is its consequence."""
    context_full: AbnormalAction = field(default=AbnormalAction.train, metadata=_EPISODE_ACTION)
    """An episode ended because the next turn would not fit the context (``env.max_context_tokens``,
    default the model's; ``train`` or ``drop``). Default train: the verifier judged the final
    state, so the reward is real."""
    episode_timeout: AbnormalAction = field(default=AbnormalAction.train, metadata=_EPISODE_ACTION)
    """An episode ended because the agent's time budget was spent (finish_reason ``timeout``;
    ``train`` or ``drop``). Default train: the reward of the state reached in time is real."""


@dataclass
class MegatronConfig(Section):
    """``learner.backend: megatron``: megatron-core's GPTModel (t1async/learner/megatron/backend.py)."""

    tensor_parallel: int = field(default=1, metadata=rule(
        lambda v: v >= 1, "an integer >= 1 that divides the attention heads, key/value heads, vocabulary and "
        "moe_intermediate_size"))
    """Tensor-parallel size T (must divide the attention heads, key/value heads, vocabulary and
    ``moe_intermediate_size``). T > 1 splits attention, vocabulary and every expert's MLP over T
    ranks with sequence parallelism (megatron-core requires it for MoE with tensor parallelism);
    with ``expert_parallel`` P the backend runs T x P ranks: P data-parallel groups of T, rank 0
    in the learner and the rest as Ray actors. Sequences are right-padded to a multiple of T."""
    pipeline_parallel: int = field(default=1, metadata=rule(
        lambda v: v >= 1, "an integer >= 1 that divides model.num_hidden_layers"))
    """Pipeline-parallel size S (must divide ``model.num_hidden_layers``; not with
    ``model.tie_word_embeddings``). S > 1 puts L/S consecutive layers on each of S stages (the
    embedding on the first, the final norm and head on the last), T x S x P ranks in all; a
    micro-batch's hidden states pass from stage to stage in the forward and their gradients back
    in the backward, one micro-batch at a time (no overlap of stages: it shards layers and their
    optimiser state, it does not run stages in parallel)."""
    expert_parallel: int = field(default=1, metadata=rule(lambda v: v >= 1, "an integer >= 1 that divides model.num_experts"))
    """Expert-parallel size N (must divide ``model.num_experts``). N > 1: the learner's backend
    is rank 0 and starts the other ranks as Ray actors (one GPU each on CUDA, no CPU reservation
    on CPU); each expert-parallel rank (with its ``tensor_parallel`` ranks) holds E/N experts of
    every MoE layer and forwards ceil(B/N) of the rows of each ``[B, T]`` micro-batch (the last
    chunks filled up with dummy rows: with ``learner.micro_batch_tokens`` 0, B = 1 and only rank
    0 does useful work); rank 0 gathers the outputs, so metrics and the learner's loss are the
    same as with one process (shared gradients summed over ranks; t1async/learner/megatron/backend.py,
    t1async/learner/megatron/ranks.py)."""
    distributed_optimizer: bool = True
    """With P = ``expert_parallel`` > 1: the weights every data-parallel rank holds (all but the
    experts) keep their float32 masters and AdamW moments sharded, 1/P per rank (ZeRO stage 1, as
    megatron-core's distributed optimizer does): each rank steps its shard and the updated weights
    are all-gathered. The same updates bit for bit (AdamW is elementwise); 12 bytes per replicated
    weight become 12/P. Off: every rank keeps them all."""
    timeout_s: float = field(default=300.0, metadata=rule(lambda v: v > 0, "a positive number of seconds"))
    """Seconds rank 0 waits for its other ranks (tensor, pipeline, expert parallel) in a
    collective before failing with an error (a dead rank is named at once); Megatron's own groups
    round it down to whole minutes (at least one), and the ranks' start-up gets at least 120 s."""
    dispatcher: Dispatcher = field(default=Dispatcher.auto, metadata=choice(
        Dispatcher, "'auto', 'allgather' or 'alltoall' (CUDA only)"))
    """MoE token dispatcher: ``allgather``, ``alltoall`` (CUDA only) or ``auto`` (alltoall on
    CUDA, allgather on CPU)."""
    dtype: TrainDtype = field(default=TrainDtype.float32, metadata=choice(TrainDtype, "float32 or bfloat16"))
    """Parameter and compute dtype: float32 or bfloat16 (router and value head stay float32). With
    bfloat16, AdamW steps float32 master copies of the weights and rounds them into the model
    (t1async.learner.backend.MasterWeightAdamW): stepped in bfloat16 directly, nearly every update at RL
    learning rates would round away."""
    gpu_memory_gib: float = field(default=0.0, metadata=rule(lambda v: v >= 0, "a number of GiB >= 0 (0: unchecked)"))
    """GiB of memory of each learner GPU. When set, the launch's pre-flight plans this layout's per-rank memory
    (parameters, gradients, float32 masters, AdamW moments, activations of one micro-batch; ``t1async plan``,
    t1async/learner/megatron/plan.py) and refuses, in one line with those numbers and the smallest layouts that
    fit, one whose largest rank needs more. 0: no check (the CPU default)."""
    device: str = field(default="auto", metadata=rule(
        lambda v: v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", v) is not None, "'auto', 'cpu', 'cuda' or 'cuda:K'"))
    """``cpu``, ``cuda`` (the current CUDA device), ``cuda:K`` or ``auto`` (cuda when available).
    With ``expert_parallel`` > 1 this is rank 0's; the other ranks get one GPU each from Ray."""


@dataclass
class LearnerConfig(Section):
    """Actor-critic learner: decoupled PPO with truncated importance weights and GAE."""

    max_steps: int = field(default=8, metadata=rule(lambda v: v >= 0, "an integer >= 0 (0: run until stopped)"))
    """Learner steps after which the run stops; 0 = run until stopped (``t1async stop RUN_DIR``,
    Ctrl-C, SIGTERM or SIGHUP). Changeable live (``t1async scale``)."""
    batch_size: int = field(default=4, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Trajectories per learner step; admission control lets ``batch_size x publish_every``
    rollouts start per published weight version."""
    max_staleness: int = field(default=1, metadata=rule(lambda v: v >= 0, "an integer >= 0"))
    """Largest allowed (learner version - oldest token version) of a trajectory trained on, in
    timeline versions (t1async/learner/timeline.py: the weight versions, but a learner restart
    does not advance them)."""
    publish_every: int = field(default=1, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Publish new weights to every sampler after this many learner steps (K)."""
    checkpoint_every: int = field(default=0, metadata=rule(lambda v: v >= 0, "an integer >= 0 (0: final checkpoint only)"))
    """Write a checkpoint every this many steps (0: only the final one)."""
    keep_checkpoints: int = field(default=2, metadata=rule(lambda v: v >= 1, "an integer >= 1 (the newest is needed to resume)"))
    """Checkpoints kept after each new one: the newest this many (>= 1), plus those of
    ``keep_every``; the others are deleted (a default checkpoint is about 95 MB: policy, critic and
    both AdamW states)."""
    checkpoint_shard_mb: int = field(default=5000, metadata=rule(lambda v: v >= 1, "an integer >= 1 (MB)"))
    """Most MB (10^6 bytes) of one safetensors shard of a checkpoint's policy; larger policies are written as
    shards with a ``model.safetensors.index.json``, as Hugging Face checkpoints are (transformers' default 5 GB)."""
    keep_every: int = field(default=0, metadata=rule(lambda v: v >= 0, "an integer >= 0 (0: keep no older history)"))
    """Also keep every checkpoint whose step is a multiple of this, for history (0 = none)."""
    episodes_per_step: int = field(default=2, metadata=rule(lambda v: v >= 0, "an integer >= 0 (0: no transcripts)"))
    """Episodes of each step's batch written as a readable transcript to
    ``RUN_DIR/episodes/step_NNNNNN.md`` (instruction, each command and its output, the verifier's
    verdict; 0 = none). The newest 200 files are kept."""
    lr: float = field(default=1e-4, metadata=rule(lambda v: v > 0, "a positive float"))
    """AdamW learning rate of the policy."""
    lr_warmup_steps: int = field(default=0, metadata=rule(lambda v: v >= 0, "an integer >= 0 (0: none)"))
    """Policy updates over which the learning rate ramps linearly up to ``lr`` (counted from the
    first policy update, after critic warm-up; 0 = none)."""
    critic_lr: float = 1e-4
    """AdamW learning rate of the critic."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    ppo_epochs: int = field(default=1, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Optimisation passes over each batch."""
    clip_eps: float = field(default=0.2, metadata=rule(lambda v: 0 < v < 1, "a float in (0, 1)"))
    """PPO ratio clip epsilon (ratio against the proximal policy)."""
    is_cap: float = field(default=2.0, metadata=rule(lambda v: v >= 1, "a float >= 1"))
    """Cap C of the truncated behaviour importance weight min(pi_prox / mu, C)."""
    value_clip: float = 0.2
    """Clip range of the value loss around the old values."""
    value_coef: float = 0.5
    """Weight of the value loss."""
    gamma: float = field(default=1.0, metadata=rule(lambda v: 0 <= v <= 1, "a float in [0, 1]"))
    """GAE discount over sampled tokens."""
    lam: float = field(default=0.95, metadata=rule(lambda v: 0 <= v <= 1, "a float in [0, 1]"))
    """GAE lambda."""
    normalize_advantages: bool = True
    """Whiten advantages over the batch's policy-loss tokens (:func:`t1async.learner.advantages.whiten`).
    ``advantage: gae``: ``(A - mean) / std`` (mean 0, std 1, as PPO does). ``group`` and ``grpo``:
    ``A / std``, not re-centred (group-level mean, batch-level std: Liu et al. 2025, "Tricks or
    Traps? A Deep Dive into RL for LLM Reasoning"), so a task whose episodes all scored alike keeps
    advantage 0 on every token and gives no gradient, and no advantage changes sign; trajectories
    of such a batch that fell back to GAE are scaled alike. The std is over tokens (a long episode
    weighs more), floored at 1e-6."""
    policy_loss: PolicyLossName = field(default=PolicyLossName.ppo, metadata=choice(
        PolicyLossName, "'ppo' (decoupled PPO with a truncated importance weight)"))
    """The policy's loss: ``ppo`` (decoupled PPO with a truncated behaviour importance weight,
    the proximal policy in the ratio's denominator; :func:`t1async.learner.rl.policy_loss`).
    The losses are registered in t1async/learner/losses.py."""
    advantage: AdvantageName = field(default=AdvantageName.gae, metadata=choice(
        AdvantageName, "'gae' (the critic), 'group' (leave-one-out over a task's episodes)"
        " or 'grpo' (group mean and standard deviation)"))
    """How each sampled token's advantage is estimated: ``gae`` (the critic, GAE over sampled
    tokens), ``group`` (leave-one-out: the episode's reward less the mean reward of the other
    episodes of its task, the same for every token; :func:`t1async.learner.rl.group_baselines`; with
    ``rollout.group_size`` > 1 so each task's episodes come in groups) or ``grpo`` (GRPO: the
    episode's reward less its group's mean, divided by the group's standard deviation;
    :func:`t1async.learner.advantages.group_normalized`). Under ``group`` and ``grpo`` a trajectory
    with no peer of its task falls back to GAE; ``group_baselined_frac`` in metrics.jsonl is the
    share that had one. The critic trains either way unless ``critic`` is off. The estimators are
    registered in t1async/learner/advantages.py."""
    group_window_steps: int = field(default=2, metadata=rule(lambda v: v >= 0, "an integer >= 0"))
    """``advantage: group`` or ``grpo``: peers trained up to this many steps before the current one count too
    (members of a group that landed in an earlier batch)."""
    critic: bool = True
    """Run and train the critic. ``advantage: group`` needs it only for trajectories without a
    peer of their task; off, those take the mean reward of the rest of the batch as baseline
    (REINFORCE's batch baseline), no critic is built (no weights, optimiser state or
    ``critic.safetensors``: one model fewer in memory) and each step skips the critic's forward,
    backward and optimiser step (the critic is a copy of the policy's trunk, so these cost about
    what the policy's do).
    Off requires ``advantage: group`` and ``critic_warmup_steps: 0``; ``value_loss`` and
    ``explained_variance`` are then absent from metrics.jsonl."""
    critic_path: str = ""
    """Checkpoint folder whose ``critic.safetensors`` warm-starts the critic ('' = the policy's trunk with a
    fresh zero value head, the default warm start)."""
    negative_advantage_weight: float = field(default=1.0, metadata=rule(lambda v: 0 <= v <= 1, "a number in [0, 1]"))
    """Multiplier of negative advantages, after whitening when ``normalize_advantages`` (0..1).
    1: the usual policy gradient. Below 1 the update leans toward what did better than the
    baseline: with group advantages (whitened or not: their whitening keeps every sign), 0 trains
    only on the episodes above their baseline; with GAE and whitening on, only on tokens above the
    batch's mean advantage (reward-filtered imitation
    of the policy's own better episodes, RAFT++ in
    Xiong et al. 2025, "A Minimalist Approach to LLM Reasoning"; Arnal et al. 2025, "Asymmetric
    REINFORCE", show why a baseline below the mean is the stable side off-policy): pushing
    failed episodes' tokens down has no floor. Measured once here it did not help: at lr 1e-3 with
    weight 0 the policy drifted within 3 minutes (README, "Warm start and learning")."""
    critic_warmup_steps: int = field(default=0, metadata=rule(lambda v: v >= 0, "an integer >= 0"))
    """Initial steps that train only the critic, on rollouts of the starting (warm-started)
    policy, before the first policy update (``phase`` is ``critic_warmup`` in metrics.jsonl)."""
    kl_coef: float = field(default=0.0, metadata=rule(lambda v: v >= 0, "a float >= 0 (0: no KL penalty)"))
    """Weight of a KL penalty to the reference policy (the warm start ``init_checkpoint``, frozen;
    the initial weights without one): ``kl_coef x`` a per-token surrogate, averaged over loss
    tokens, is added to the policy loss (as InstructGPT, Ouyang et al. 2022, anchors PPO), whose
    gradient estimates that of KL(pi_theta || pi_ref) at each token's state from the sampler's
    tokens: ``sg(rho) (log pi_theta - log pi_ref)^2 / 2`` with the importance weight rho =
    pi_theta / mu, its behaviour part capped at ``is_cap`` (:func:`t1async.learner.rl.kl_penalty`;
    Tang & Munos 2025; differentiating the k3 estimate would descend KL(pi_ref || pi_theta)). It
    keeps behaviour the reward does not see (ending with the end signal, the shape of commands)
    from drifting. 0 = off (no reference is kept). Reported as ``kl_ref``: the k3 estimate of
    KL(pi_theta || pi_ref) (Schulman 2020), weighted by rho."""
    reward: Reward = field(default=Reward.dense, metadata=choice(Reward, "'dense' (tests passed) or 'binary' (resolved)"))
    """Episode reward: ``dense`` (the number of verifier tests passed, the reference's choice) or
    ``binary`` (1 when resolved, else 0)."""
    routing_replay: bool = True
    """Replay the sampler's routed experts in every MoE layer (R3)."""
    init_checkpoint: str = ""
    """Folder with model.safetensors + config.json to warm-start the policy from ('' = random init)."""
    dump_trajectories: int = 0
    """Write the first N received trajectory frames to RUN_DIR/trajectories/ (``ID.traj``; read
    them with ``t1async.trajectory.decode``) for inspection."""
    batch_timeout_s: float = field(default=600.0, metadata=rule(
        lambda v: v > 0, "a positive number of seconds (the longest wait for a batch)"))
    """Longest wait for one batch before the learner reports it is starved and stops; under
    ``rollout.admission: learner_wait`` also the longest it holds a publish for a slow episode
    (it then publishes anyway, logged, and drops what that makes too stale)."""
    disk_floor_mb: float = field(default=1024.0, metadata=rule(
        lambda v: v >= 0, "MiB of free space >= 0 (0: no floor of its own)"))
    """Free-space floor of the run directory's filesystem, MiB: below it (or below 5 % of the
    filesystem's size, if that is less) the learner pauses intake and training before the disk is
    full: it stops ACKing (rollout actors keep their trajectories in their spools), runs no step,
    and ``t1async status`` says ``degraded: disk full at PATH (N MB free)``; it resumes by itself
    once space is back. A write that fails on a full or failing disk (ENOSPC, EDQUOT, EIO) pauses
    it the same way, at any floor (t1async/fileio.py ``DiskGuard``). Once a checkpoint was written,
    the floor is at least 1.1 times its size, whatever this says (the next one must fit: no
    pause-resume flapping while every checkpoint fails). 0: no floor of its own."""
    micro_batch_tokens: int = field(default=4096, metadata=rule(
        lambda v: v >= 0, "an integer >= 0 (0: one trajectory per micro-batch)"))
    """Trajectories trained in one padded forward and backward, up to this many positions
    (sequences x the longest, :func:`t1async.learner.rl.micro_batches`; longest first). Results equal
    one forward per trajectory up to float summation order (tests/unit/learner/test_learner.py); fewer,
    larger matmuls are faster (``t1async bench micro-batch``). 0 = one trajectory per micro-batch."""
    max_tokens_per_chunk: int = field(default=4096, metadata=rule(lambda v: v >= 0, "an integer >= 0 (0: never chunk)"))
    """A micro-batch whose sequences are longer than this many positions (a long episode, alone in
    its micro-batch at the default ``micro_batch_tokens``) is trained in chunks, so a long episode
    (100k tokens and more) fits in memory: the LM head and its log-probs run this many positions at
    a time and every decoder layer is activation-checkpointed (recomputed in the backward). On
    both backends; the ``megatron`` one recomputes each layer with the experts its forward used
    (replayed, or the router's own, checked: t1async/learner/megatron/model.py ``LayerRecompute``).
    Log-probs, values and routing are those of one plain forward, gradients equal up to float
    summation order (tests/unit/learner/test_long_horizon.py, tests/unit/learner/test_megatron.py). Each step's metrics count
    the micro-batches trained so (``chunked_micro_batches``). Memory and time on the episode of
    ``t1async bench long-horizon``: README "Long episodes". Shorter micro-batches take the plain
    forward, unchanged. 0 = never chunk."""
    abnormal: AbnormalConfig = field(default_factory=AbnormalConfig)
    """What to train of episodes and turns that did not end normally (see :class:`AbnormalConfig`)."""
    backend: LearnerBackendName = field(default=LearnerBackendName.torch, metadata=choice(
        LearnerBackendName, "'torch' (plain PyTorch) or 'megatron' (megatron-core; pip install 't1async[megatron]')"))
    """Training engine: ``torch`` (plain PyTorch, t1async/models/model.py; the CPU default) or
    ``megatron`` (megatron-core GPTModel, ``pip install 't1async[megatron]'``). Checkpoints are
    Hugging Face safetensors either way, so a resumed run may switch."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Settings of the ``megatron`` backend."""
    resume: bool = False
    """Resume in ``run.dir`` (give the killed run's directory): restore the latest checkpoint
    (weights, optimisers, step, version, the ids it consumed; the controller continues the task
    order saved with it), then train on every trajectory in
    the receive log that checkpoint had not consumed. No checkpoint: start at step 0 and replay
    the whole log. Off: a receive log left in ``run.dir`` is discarded."""
    resume_from_scratch: bool = False
    """Allow a resume whose checkpoints are all gone although the run wrote some
    (``receive_log/checkpointed``) to start again from the initial weights (``metrics.jsonl`` is cut
    back to step 0; what the receive log still holds is trained again). Off: such a resume is
    refused in one line, as it would throw the run's trained steps away."""


@dataclass
class MismatchConfig(Section):
    """``t1async mismatch``: training-vs-inference mismatch of one set of rollouts (t1async/commands/mismatch.py)."""

    episodes: int = field(default=8, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Episodes to roll out (tasks taken in turn from ``env.tasks`` or every shipped task)."""
    learner_dtype: TrainDtype = field(default=TrainDtype.float32, metadata=choice(TrainDtype, "float32 or bfloat16"))
    """dtype of the learner-side model that re-scores the rollouts: float32 or bfloat16."""
    init_checkpoint: str = ""
    """Folder with model.safetensors + config.json for the policy ('' = random init, seeded)."""
    pretrain_steps: int = 0
    """Train the policy this many steps on text (the shipped tasks rendered as episodes, plus
    Python standard-library sources) before the rollouts, so that its experts specialise."""
    pretrain_seq_len: int = 128
    """Tokens per pretraining window."""
    pretrain_batch: int = 8
    """Windows per pretraining step."""
    pretrain_lr: float = 2e-3
    """AdamW learning rate of the pretraining."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss during pretraining (Switch Transformer's
    ``E * sum_e f_e * P_e``, Fedus et al. 2021), which keeps every expert in use."""
    save_checkpoint: str = ""
    """Write the (pretrained) policy here before the rollouts ('' = do not)."""


@dataclass
class SftConfig(Section):
    """``t1async sft``: supervised warm start on oracle demonstrations (t1async/commands/sft.py)."""

    steps: int = field(default=400, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Optimizer steps."""
    batch_size: int = field(default=8, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Demonstrations per step (drawn without replacement within a step, seeded)."""
    lr: float = field(default=3e-3, metadata=rule(lambda v: v > 0, "a positive float"))
    """Peak AdamW learning rate (linear warm-up, then cosine decay to 10 %)."""
    warmup_steps: int = field(default=20, metadata=rule(lambda v: v >= 0, "an integer >= 0"))
    """Steps of linear learning-rate warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss, which keeps every expert in use."""
    max_demos: int = field(default=0, metadata=rule(lambda v: v >= 0, "an integer >= 0 (0: all)"))
    """Use at most this many demonstrations (the first by task name; 0 = all)."""
    seed: int = 0
    """Seed of the batch order."""
    log_every: int = field(default=20, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Steps per point of the reported loss curve."""
    threads: int = 2
    """torch intra-op threads of the training process."""
    build_concurrency: int = field(default=2, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    """Demonstration episodes run at once, each in its own sandbox."""
    early_stop_frac: float = field(default=0.0, metadata=rule(lambda v: 0 <= v < 1, "a float in [0, 1)"))
    """An imperfect demonstrator (0 <= f < 1; default 0, the oracle): this fraction of the tasks
    (chosen by ``seed``) is played by a demonstrator that sends the end signal in place of the
    oracle's last command (an oracle of one command is played whole, and not counted as stopped
    early), and the demonstration is kept although its verifier does not resolve it, as an
    unfiltered set of a weaker agent's episodes would be (stopping before the task is done is a
    common failure of terminal agents). The warm start then learns to stop early on tasks whose
    oracle has several commands: a behaviour the verifier's reward can correct and imitation
    cannot (``t1async bench learning``)."""
