"""Container images: the engine (podman or docker) and its cached builds, a task's image and
verifier layer, and the offline stand-ins for official base images."""
