"""The policy: the MoE model, the tokenizer and chat template."""
