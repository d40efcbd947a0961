"""The learner's algorithm: one update step, advantage estimators and policy losses, RL maths, backends, checkpoints."""
