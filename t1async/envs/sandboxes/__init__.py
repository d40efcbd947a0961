"""Sandboxes: the :class:`~t1async.envs.protocol.Sandbox` protocol, its registry
(``SANDBOXES``) and the backends (``local`` bubblewrap, ``container`` podman/docker, ``modal``),
with the shell I/O and resource limits they share."""
