"""The Megatron-core learner backend (``learner.backend: megatron``): model, conversion, expert-parallel ranks."""
