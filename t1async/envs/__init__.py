"""Terminal environments, imported as ``t1async.envs``: one episode's environment
(:mod:`~t1async.envs.terminal`) and its verifier (:mod:`~t1async.envs.verifier`) at the top, and
four wings: ``taskio/`` (task folders, Dockerfile and compose parsing, per-sandbox plans),
``sandboxes/`` (the protocol and its backends), ``images/`` (container engine, task images,
stand-ins) and ``commands/`` (eval, synth, decontam, images, tasks). ``tasks/`` holds the shipped
tasks (data, not code)."""
