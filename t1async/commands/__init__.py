"""Commands beside the service: the SFT warm start, the mismatch measurement, the soak, the metrics plot,
the model folder, the memory plan, and the environment commands ``eval``, ``images``, ``synth``,
``decontam`` (argument parsing in :mod:`~t1async.commands.env_cli`)."""
