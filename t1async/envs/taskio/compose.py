"""A task's docker-compose.yaml, read as the Terminal-Bench harnesses read it.

Both harnesses run ``docker compose`` with variables of their own in the environment, and task
files use them: Harbor (TB2) sets ``CONTEXT_DIR`` (the task's ``environment/`` folder),
``TEST_DIR``, ``MAIN_IMAGE_NAME`` and log paths; the TB1 harness sets ``T_BENCH_TEST_DIR``,
``T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME`` and others. :func:`harness_variables` gives the values
each harness would give, :func:`interpolate` substitutes them with Compose's rules, and
:func:`read_compose` returns what t1async needs of the file (:class:`ComposeFile`): the agent's
service (its build, image and environment) and every other service as a sidecar
(:class:`~t1async.envs.protocol.ServiceSpec`).

Sources: the Compose specification, "Interpolation"
(https://github.com/compose-spec/compose-spec/blob/main/spec.md#interpolation); Harbor's
``DockerEnvironment`` (its compose environment variables); the TB1 harness's
``DockerComposeManager`` (``T_BENCH_*`` variables).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..protocol import ServiceSpec
from .dockerfile import ENV_KEY

MAIN_SERVICES = ("main", "client")
"""Names of the agent's own service: Harbor's ``main`` (TB2), the TB1 harness's ``client``."""

_AGENT_NAMES = ("MAIN_IMAGE_NAME", "T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME", "T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME")
"""Variables whose value is the name the harness chooses for the agent's image or container: a
service whose ``image`` or ``container_name`` uses one is the agent's (TB1's harness finds its
container that way), and such an ``image`` means "build", not "pull"."""

_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")


class ComposeError(ValueError):
    """The compose file cannot be used; ``what`` says what is wrong and ``todo`` what to do."""

    def __init__(self, what: str, todo: str):
        super().__init__(f"{what}; {todo}")
        self.what, self.todo = what, todo


def harness_variables(layout: str, environment_dir: Path) -> dict[str, str]:
    """The variables the task's own harness sets when it runs ``docker compose``.

    Args:
        layout: ``"tb2"`` (Harbor) or ``"tb1"``.
        environment_dir: the folder holding the compose file and Dockerfile (Harbor's
            ``CONTEXT_DIR``).

    Returns:
        Name -> value. Names the harness gives a run-specific value (image and container names,
        host log folders) are absent: a reference to one stays unresolved (see
        :func:`interpolate`), and :func:`read_compose` treats it as the harness's choice.
    """
    if layout == "tb2":
        return {"CONTEXT_DIR": str(environment_dir), "TEST_DIR": "/tests",
                "ENV_VERIFIER_LOGS_PATH": "/logs/verifier", "ENV_AGENT_LOGS_PATH": "/logs/agent"}
    return {"T_BENCH_TEST_DIR": "/tests", "T_BENCH_CONTAINER_LOGS_PATH": "/logs",
            "T_BENCH_CONTAINER_AGENT_LOGS_PATH": "/agent-logs"}


def interpolate(value: str, variables: dict[str, str]) -> tuple[str, set[str]]:
    """Substitute ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
    ``${VAR:+alt}``, ``${VAR+alt}``, ``${VAR:?message}``, ``${VAR?message}`` and ``$$`` as Compose
    does (``:`` forms treat an empty value as unset).

    Args:
        value: one string of the compose file.
        variables: name -> value (see :func:`harness_variables`).

    Returns:
        (the string, the names it used that are not in ``variables`` and had no default). An
        unresolved name is replaced by the empty string, as Compose does; callers decide whether
        the field is still usable.

    Raises:
        ComposeError: a ``${VAR?message}`` whose variable is unset.
    """
    unresolved: set[str] = set()

    def one(match: re.Match) -> str:
        if match.group(1):
            return "$"
        name = match.group(2) or match.group(5)
        op, arg = match.group(3), match.group(4) or ""
        present = name in variables and (variables[name] != "" or not (op or "").startswith(":"))
        if op in ("-", ":-"):
            return variables[name] if present else arg
        if op in ("+", ":+"):
            return arg if present else ""
        if op in ("?", ":?"):
            if not present:
                raise ComposeError(f"${{{name}}} is required ({arg or 'no message'}) and t1async does not set it",
                                   "give it a default (${NAME:-value})")
            return variables[name]
        if name not in variables:
            unresolved.add(name)
            return ""
        return variables[name]

    return _VARIABLE.sub(one, value), unresolved


@dataclass
class ComposeFile:
    """What t1async uses of a task's docker-compose.yaml.

    Attributes:
        agent_service: the name of the agent's service, or "" when the file has none.
        context_dir, dockerfile: the agent's build, when it is not the default (the compose file's
            own folder and its ``Dockerfile``); both resolved.
        image: the agent's image when it names one and does not build.
        environment: the agent's ``environment`` entries with the harness's variables substituted
            (an entry that uses a run-specific harness variable is left out).
        services: every other service, as a sidecar.
        service_names: every service's name, in file order.
    """

    agent_service: str = ""
    context_dir: Path | None = None
    dockerfile: Path | None = None
    image: str = ""
    environment: dict[str, str] = field(default_factory=dict)
    services: list[ServiceSpec] = field(default_factory=list)
    service_names: list[str] = field(default_factory=list)


def read_compose(path: Path, variables: dict[str, str]) -> ComposeFile:
    """Read ``path`` (a docker-compose.yaml) with the harness's ``variables`` substituted.

    The agent's service is the one named ``main`` or ``client``, else the one whose ``image`` or
    ``container_name`` is the harness's agent name (``${MAIN_IMAGE_NAME}``,
    ``${T_BENCH_TASK_DOCKER_CLIENT_...}``), else the only service.

    Raises:
        ComposeError: invalid YAML; several services and none is the agent's; a build whose
            Dockerfile does not exist or whose path uses a variable nobody sets; a sidecar with
            neither ``build`` nor ``image``.
    """
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ComposeError(f"{path.name} is not valid YAML ({str(exc).splitlines()[0]})", "fix its syntax") from None
    services = data.get("services") if isinstance(data, dict) else None
    result = ComposeFile()
    if not isinstance(services, dict) or not services:
        return result
    result.service_names = [str(name) for name in services]
    bodies = {str(name): body if isinstance(body, dict) else {} for name, body in services.items()}
    agent = _agent_service(bodies)
    if agent is None:
        raise ComposeError(f"{path.name} defines services {sorted(bodies)} but none is the agent's",
                           "name the agent's service 'main' (Harbor) or 'client' (Terminal-Bench 1), or give it "
                           "image: ${MAIN_IMAGE_NAME}")
    result.agent_service = agent
    main = bodies[agent]
    result.services = [_sidecar(path, name, body, main, variables) for name, body in bodies.items() if name != agent]
    build = main.get("build")
    if build:  # e.g. TB1's `client: {build: {context: client}}`, Harbor's `context: ${CONTEXT_DIR}/..`
        context, dockerfile = _build(path, f"the agent's service {agent!r}", build, variables, check=False)
        if (context, dockerfile) != (path.parent.resolve(), (path.parent / "Dockerfile").resolve()):
            _build(path, f"the agent's service {agent!r}", build, variables)
            result.context_dir, result.dockerfile = context, dockerfile
    image, unresolved = interpolate(str(main.get("image") or ""), variables)
    if image and not build and not unresolved:
        result.image = image
    result.environment = {key: value for key, value in _environment(main, variables) if ENV_KEY.match(key)}
    return result


def _environment(body: dict, variables: dict[str, str]) -> list[tuple[str, str]]:
    """A service's ``environment`` (a mapping or ``KEY=value`` list) as (key, value) pairs,
    interpolated; an entry that uses a variable nobody sets is left out."""
    env = body.get("environment") or {}
    pairs = env.items() if isinstance(env, dict) else (str(e).partition("=")[::2] for e in env)
    out = []
    for key, value in pairs:
        text, unresolved = interpolate("" if value is None else str(value), variables)
        if not unresolved:
            out.append((str(key), text))
    return out


def _agent_service(bodies: dict[str, dict]) -> str | None:
    """The agent's service name among ``bodies`` (see :func:`read_compose`), or None."""
    named = next((name for name in MAIN_SERVICES if name in bodies), None)
    if named:
        return named
    for name, body in bodies.items():
        text = f"{body.get('image') or ''} {body.get('container_name') or ''}"
        if any(f"${{{var}}}" in text or f"${var}" in text for var in _AGENT_NAMES):
            return name
    return next(iter(bodies)) if len(bodies) == 1 else None


def _build(path: Path, who: str, build: Any, variables: dict[str, str], *, check: bool = True) -> tuple[Path, Path]:
    """A compose ``build`` (a context path, or ``{context, dockerfile}``, relative to the compose
    file; ``dockerfile`` relative to the context) as (context folder, Dockerfile), both resolved.

    Raises:
        ComposeError: a path uses a variable nobody sets, or (``check``) the Dockerfile does not
            exist (``who`` names the service).
    """
    spec = build if isinstance(build, dict) else {"context": build}
    raw_context, raw_dockerfile = str(spec.get("context") or "."), str(spec.get("dockerfile") or "Dockerfile")
    context_text, missing = interpolate(raw_context, variables)
    dockerfile_text, missing_df = interpolate(raw_dockerfile, variables)
    if missing | missing_df:
        raise ComposeError(f"{path.name}: {who} builds from {raw_context!r} / {raw_dockerfile!r}, which use "
                           f"{', '.join('$' + n for n in sorted(missing | missing_df))} (not set by the harness)",
                           "use a path relative to the compose file")
    context = (path.parent / context_text).resolve()
    dockerfile = (context / dockerfile_text).resolve()
    if check and not dockerfile.is_file():
        raise ComposeError(f"{path.name}: {who} builds from {dockerfile}, which does not exist",
                           "add it or fix build.context/dockerfile")
    return context, dockerfile


def _duration_s(value: Any, default: float) -> float:
    """A compose duration (``2s``, ``1m30s``, ``500ms``, or a number of seconds) in seconds."""
    if value is None:
        return default
    if isinstance(value, (int, float)):
        return float(value)
    parts = _DURATION.findall(str(value))
    if not parts or "".join(a + b for a, b in parts) != str(value).strip():
        return default
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(number) * scale[unit] for number, unit in parts)


def _sidecar(path: Path, name: str, body: dict, main: dict, variables: dict[str, str]) -> ServiceSpec:
    """One service beside the agent's, as a :class:`ServiceSpec`.

    Raises:
        ComposeError: it has neither ``build`` nor ``image``, or its Dockerfile is missing.
    """
    build = body.get("build")
    context, dockerfile = _build(path, f"service {name!r}", build, variables) if build else (None, None)
    image, unresolved = interpolate(str(body.get("image") or ""), variables)
    if unresolved:  # a harness-chosen name (TB1's ${T_BENCH_...}__server), not an image to pull
        image = ""
    if not build and not image:
        raise ComposeError(f"{path.name}: service {name!r} has neither build nor image", "give it one")
    command = body.get("command")
    if isinstance(command, str):
        command = ("sh", "-c", command)
    elif isinstance(command, list):
        command = tuple(str(c) for c in command)
    else:
        command = None
    environment = _environment(body, variables)
    check = body.get("healthcheck") if isinstance(body.get("healthcheck"), dict) else {}
    test = check.get("test")
    if isinstance(test, str):
        healthcheck: tuple[str, ...] | None = ("sh", "-c", test)
    elif isinstance(test, list) and test and test[0] == "CMD":
        healthcheck = tuple(str(t) for t in test[1:])
    elif isinstance(test, list) and len(test) == 2 and test[0] == "CMD-SHELL":
        healthcheck = ("sh", "-c", str(test[1]))
    else:  # absent, or ["NONE"]
        healthcheck = None
    depends = main.get("depends_on") or {}
    condition = depends.get(name) if isinstance(depends, dict) else None
    wait = isinstance(condition, dict) and condition.get("condition") == "service_healthy"
    return ServiceSpec(
        name=name, dockerfile=dockerfile, context_dir=context, image=image, command=command,
        environment=tuple(environment), healthcheck=healthcheck, wait_healthy=wait and healthcheck is not None,
        health_interval_s=_duration_s(check.get("interval"), 2.0), health_retries=int(check.get("retries", 15)),
        health_start_period_s=_duration_s(check.get("start_period"), 0.0))
