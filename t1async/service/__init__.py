"""The launch process: start, supervise and stop the Ray roles (launch, service, sampler pool, control socket, run dir, reaper)."""
