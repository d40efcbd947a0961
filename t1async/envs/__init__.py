"""Terminal environments, imported as ``t1async.envs``: one episode's environment
(:mod:`~t1async.envs.terminal`) and its verifier (:mod:`~t1async.envs.verifier`) at the top, built on
four sub-wings, lowest first: ``protocol/`` (the sandbox contract and the specs tasks and backends share),
``taskio/`` (task folders, Dockerfile and compose parsing, per-sandbox plans), ``images/`` (container
engine, task images, stand-ins) and ``sandboxes/`` (the backends and their registry). ``tasks/`` holds the
shipped tasks (data, not code). The commands that drive them (eval, synth, decontam, images) live in
``t1async/commands/``."""
