"""Sampling: the embedded engine, the sampler clients (HTTP, routed), the SGLang server."""
