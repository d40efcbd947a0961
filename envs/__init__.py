"""Terminal environments: task loading, sandboxes, verifiers and the shipped tasks."""
