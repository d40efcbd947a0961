"""The environment commands: ``t1async eval``, ``synth``, ``decontam``, ``tasks`` and ``images``
(argument parsing in :mod:`~t1async.envs.commands.cli`)."""
