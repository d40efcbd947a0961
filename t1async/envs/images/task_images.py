"""A task's images for the ``container`` sandbox: the task image built from its own Dockerfile
(bases resolved to stand-ins where missing) and the verifier layer on top of it. See
:mod:`t1async.envs.images.engine` for caching, locking and build errors.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

from ..taskio.dockerfile import expand_heredocs, from_images, rewrite_from
from .engine import TASK_REPO, VERIFIER_DIR, Engine, _build, _build_lock, _safe_name, context_hash
from .stand_ins import ensure_base, resolve_base


def ensure_task_image(engine: Engine, *, name: str, dockerfile: Path | None, context_dir: Path | None,
                      docker_image: str = "", log: Path | None = None) -> str:
    """The image of a task, built if missing (see the module docstring); returns its reference.

    Without a Dockerfile the task's ``docker_image`` is used (its stand-in if missing locally),
    else ``debian:bookworm``.

    Raises:
        BuildError: the build failed.
        SandboxError: a ``FROM`` image is missing and has no stand-in (run ``t1async images bootstrap``).
    """
    if dockerfile is None:
        return ensure_base(engine, docker_image or "debian:bookworm")
    original = dockerfile.read_text()
    text, files = expand_heredocs(original)
    resolved = {image: resolve_base(engine, image) for image in from_images(text)}
    bases = [image_id for _, image_id in resolved.values()]
    key = context_hash(original, context_dir, extra=f"{engine.name}|{sorted(files)}|{bases}")
    tag = f"{TASK_REPO}/{_safe_name(name)}:{key}"
    text = rewrite_from(text, {image: local for image, (local, _) in resolved.items() if local != image})
    with _build_lock(tag):
        if not engine.image_exists(tag):
            _build(engine, tag, text, context_dir, files, log, source_text=original)
        elif log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as handle:
                handle.write(f"# image {tag} found in the cache (Dockerfile and context unchanged)\n")
    return tag


def ensure_verifier_image(engine: Engine, base: str, *, debs: list[str], requirements: list[str],
                          log: Path | None = None, optional_debs: list[list[str]] | None = None) -> str:
    """``base`` plus the verifier layer (see the module docstring); returns its reference.

    Args:
        base: the task image.
        debs: Debian packages the test script installs with apt (a failure fails the build).
        requirements: Python requirements it installs (``pytest`` is added when absent).
        optional_debs: ``apt-get install`` lines the test script survives the failure of, one
            list each: each is installed on its own and a failure is tolerated (the build log
            says so), as the script would run past it.

    Raises:
        BuildError: the layer could not be built (no network at build time, a package that does
            not exist); the container sandbox makes it the episode's error.
    """
    reqs = list(dict.fromkeys(requirements))
    if not any(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() == "pytest" for r in reqs):
        reqs.insert(0, "pytest")
    user = engine.image_config(base).get("User") or ""
    lines = [f"FROM {base}", "USER root"]
    apt = ("if command -v apt-get >/dev/null; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive "
           "apt-get install -y -qq --no-install-recommends {} >/dev/null; fi")
    needs = list(debs)
    tolerated = [
        "{ apt-get install -y -qq --no-install-recommends " + " ".join(shlex.quote(p) for p in group)
        + " >/dev/null 2>&1 || echo " + shlex.quote(f"t1async: the test script's `apt-get install {' '.join(group)}` "
                                                      "failed; it runs past that line, so does the verifier layer")
        + "; }" for group in (optional_debs or []) if group]
    if tolerated:
        lines.append("RUN if command -v apt-get >/dev/null; then apt-get update -qq && export "
                     "DEBIAN_FRONTEND=noninteractive && " + " && ".join(tolerated) + "; fi")
    # Each part in braces: `A && B || C` would run C when A failed and hide A's failure.
    lines.append("RUN " + " && ".join("{ " + part + "; }" for part in filter(None, [
        apt.format(" ".join(sorted(set(needs)))) if needs else "",
        "(command -v python3 >/dev/null && python3 -m venv --help >/dev/null 2>&1) || " + apt.format("python3 python3-venv"),
    ])))
    quoted = " ".join(json.dumps(r) for r in reqs)
    # The venv's pip goes once the requirements are in: `python -m pip` in a test is then the
    # image's pip (through --system-site-packages), broken or mended by the agent.
    keep_pip = any(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() == "pip" for r in reqs)
    lines.append(f"RUN python3 -m venv --system-site-packages {VERIFIER_DIR} && "
                 f"{VERIFIER_DIR}/bin/python -m pip install -q --disable-pip-version-check --no-input {quoted}"
                 + ("" if keep_pip else f" && {VERIFIER_DIR}/bin/python -m pip uninstall -q -y pip"))
    if user and user not in ("root", "0"):
        lines.append(f"USER {user}")
    text = "\n".join(lines) + "\n"
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    tag = f"{base.rsplit(':', 1)[0]}-verifier:{key}"
    with _build_lock(tag):
        if not engine.image_exists(tag):
            _build(engine, tag, text, None, {}, log)
    return tag
