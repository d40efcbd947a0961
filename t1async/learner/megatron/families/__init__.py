"""Model families on the megatron learner beyond qwen3_moe (t1async/learner/megatron/model.py and convert.py hold
qwen3_moe's spec and names, and dispatch here by ``model_type``): one module per family."""
