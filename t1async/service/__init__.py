"""The launch process: start, supervise and stop the Ray roles.

Launch, service supervision, the sampler pool, the control socket, the run dir and the reaper.
"""
