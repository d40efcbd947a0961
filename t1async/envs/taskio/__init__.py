"""Task I/O: a task folder read into a :class:`~t1async.envs.taskio.task.Task` (both layouts), its
Dockerfile and compose file parsed, its shell scripts split into words, and the per-sandbox plans
that adapt its scripts to the sandbox that runs them."""
