"""Transport: trajectories from rollout actors to the learner over ZeroMQ (spool, receive log, ledger, keys)."""
