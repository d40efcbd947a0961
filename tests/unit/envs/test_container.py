"""The ``container`` backend: image plumbing (no engine needed) and, marked ``container``, real
podman runs of the fidelity fixtures in tests/fixtures/container and of escape attempts.

The fixtures are this project's own: ``tb2-fidelity`` (COPY and RUN heredocs writing outside
/app, a Terminal-Bench-2-style test.sh that fetches curl, uv, pytest and the ctrf plugin at test
time) and ``tb1-uv-helpers`` (the TB1 ``setup-uv-pytest.sh``/``run-uv-pytest.sh`` pair that the
task folder lacks, ``uv add``, a ``solution.yaml`` oracle of plain commands) and ``tb2-sidecar``
(a docker-compose.yaml with a second service, built from its own Dockerfile, that the agent
reaches by name once its health check passes).
"""

from __future__ import annotations

import os
import random
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from t1async.commands.evaluate import choose_sandbox, short_error
from t1async.config import ContainerConfig
from t1async.envs.images.engine import Engine, context_hash, resolve_engine
from t1async.envs.images.stand_ins import normalise, qualified, stand_in_for
from t1async.envs.images.task_images import ensure_task_image
from t1async.envs.protocol import SandboxLimits, SandboxSpec
from t1async.envs.sandboxes.container import ContainerSandbox, remove_orphan_containers
from t1async.envs.taskio.adapt import adapt_script
from t1async.envs.taskio.dockerfile import expand_heredocs, from_images, rewrite_from
from t1async.envs.taskio.loading import load_task
from t1async.envs.taskio.packages import VerifierNeeds
from t1async.envs.taskio.pytest_runner import CONTAINER_PYTHON, pytest_command
from t1async.envs.taskio.task import TaskError
from t1async.envs.terminal import TerminalEnv, validate_task
from tests.support import FIXTURES, REPO
from tests.support.container_support import base_image

FIXTURES = FIXTURES / "container"
SHIPPED = REPO / "t1async" / "envs" / "tasks"


# ------------------------------------------------------------------------------ no engine needed


def test_copy_and_run_heredocs_are_rewritten():
    text, files = expand_heredocs(
        "FROM x\nCOPY <<EOT /opt/a.txt\nline 1\n# not a comment here\nEOT\n"
        "RUN <<'EOF'\nset -e\necho \"$HOME\" > /b\nEOF\n"
        "RUN python3 - <<EOF\nprint(1)\nEOF\nRUN echo plain \\\n  continued\n")
    assert files == {".t1async-heredoc-0": "line 1\n# not a comment here\n"}
    lines = text.splitlines()
    assert lines[1] == "COPY .t1async-heredoc-0 /opt/a.txt"
    assert lines[2] == 'RUN ["/bin/sh", "-c", "set -e\\necho \\"$HOME\\" > /b\\n"]'
    assert lines[3] == 'RUN ["/bin/sh", "-c", "python3 - <<EOF\\nprint(1)\\nEOF\\n"]'
    assert lines[4:] == ["RUN echo plain \\", "  continued"]


def test_from_images_skips_stage_names():
    text = "FROM python:3.13-slim AS build\nFROM --platform=linux/amd64 debian:bookworm\nCOPY --from=build /a /a\nFROM build\n"
    assert from_images(text) == ["python:3.13-slim", "debian:bookworm"]


def test_copy_from_an_image_is_an_image_the_build_needs():
    text = ("FROM python:3.12-slim\nCOPY --from=ghcr.io/astral-sh/uv:0.8.15 /uv /uvx /usr/local/bin/\n"
            "FROM debian:bookworm AS two\nCOPY --chown=1:1 --from=0 /x /x\nCOPY --from=two /y /y\n")
    assert from_images(text) == ["python:3.12-slim", "ghcr.io/astral-sh/uv:0.8.15", "debian:bookworm"]
    out = rewrite_from(text, {"ghcr.io/astral-sh/uv:0.8.15": "localhost/uv:1", "debian:bookworm": "localhost/deb:1"})
    assert "COPY --from=localhost/uv:1 /uv /uvx" in out and "FROM localhost/deb:1 AS two" in out
    assert "--from=0 /x" in out and "--from=two /y" in out  # stages stay stages


@pytest.mark.parametrize("ref, suite", [
    ("python:3.13-slim-bookworm", "bookworm"), ("python:3.11-slim", "bookworm"), ("docker.io/library/python:3.12", "trixie"),
    ("debian:bookworm-slim", "bookworm"), ("ubuntu:24.04", "trixie"), ("ubuntu:22.04", "bookworm"),
    ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", "bookworm"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest", "trixie"), ("alpine:3.20", None), ("node:20", None),
])
def test_stand_ins(ref, suite):
    rule = stand_in_for(ref)
    assert (rule.suite if rule else None) == suite
    if rule:
        assert rule.differences  # every substitution is reported


def test_names_resolve_like_the_engine():
    assert normalise("docker.io/library/python:3.13") == "python:3.13"
    assert qualified("python:3.13-slim") == "docker.io/library/python:3.13-slim"
    assert qualified("ghcr.io/laude-institute/t-bench/python-3-13:20250620").startswith("ghcr.io/")
    assert qualified("someone/tool") == "docker.io/someone/tool:latest"


def test_context_hash_follows_content_and_mode(tmp_path):
    (tmp_path / "a.sh").write_text("echo 1\n")
    first = context_hash("FROM x\n", tmp_path)
    assert context_hash("FROM x\n", tmp_path) == first
    os.chmod(tmp_path / "a.sh", 0o755)
    second = context_hash("FROM x\n", tmp_path)
    (tmp_path / "a.sh").write_text("echo 2\n")
    assert len({first, second, context_hash("FROM x\n", tmp_path), context_hash("FROM y\n", tmp_path)}) == 4


def test_ulimits_stay_within_the_hosts_hard_limits():
    engine = Engine("podman", ["podman"], ContainerConfig(ulimit_nofile=10**9, ulimit_nproc=1000))
    opts = engine.ulimits()
    nofile = int(opts[opts.index("--ulimit") + 1].split("=")[1].split(":")[0])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert nofile == (10**9 if hard == resource.RLIM_INFINITY else min(10**9, hard))
    assert "nproc=1000:1000" in opts or resource.getrlimit(resource.RLIMIT_NPROC)[1] < 1000


def test_container_test_script_moves_installs_to_the_verifier_layer():
    task = load_task(FIXTURES / "tb2-fidelity")
    needs = task.verifier_needs
    assert needs.optional_debs == [("curl",)] and not needs.debs  # no set -e: the script survives the line failing
    assert needs.requirements == ["pytest==8.3.5"]  # the ctrf plugin is report-only
    script = task.container_test_script
    assert "astral.sh" not in script and "apt-get" not in script and "uvx" not in script
    assert f"{pytest_command(CONTAINER_PYTHON)} /tests/test_outputs.py -rA\n" in script
    assert "--ctrf" not in script and "reward.txt" in script


def test_tb1_helpers_the_folder_lacks_are_supplied():
    task = load_task(FIXTURES / "tb1-uv-helpers")
    assert task.verifier_needs.requirements == ["iniconfig==2.0.0"]
    lines = [line for line in task.container_test_script.splitlines() if line and not line.startswith("#")]
    assert lines == ["true", "true", f'{pytest_command(CONTAINER_PYTHON)} -rA "$TEST_DIR/test_outputs.py"']
    # a helper the tests folder ships is run as written
    needs = VerifierNeeds()
    kept = adapt_script("source $TEST_DIR/setup-uv-pytest.sh\n", test_script=True, allow_internet=False,
                        collect=needs, present=frozenset({"setup-uv-pytest.sh"}))
    assert kept == "source $TEST_DIR/setup-uv-pytest.sh\n"


def test_tb1_task_without_run_tests_gets_the_harness_default(tmp_path):
    folder = tmp_path / "no-run-tests"
    (folder / "tests").mkdir(parents=True)
    (folder / "task.yaml").write_text("instruction: do it\n")
    (folder / "tests" / "test_outputs.py").write_text("def test_x():\n    pass\n")
    task = load_task(folder)
    for script, python in ((task.container_test_script, CONTAINER_PYTHON), (task.local_test_script, "python3")):
        lines = [line for line in script.splitlines() if line and not line.startswith("#")]
        assert lines == ["true", f'{pytest_command(python)} -rA "$TEST_DIR/test_outputs.py"']


def test_solution_yaml_plain_commands_are_an_oracle(tmp_path):
    task = load_task(FIXTURES / "tb1-uv-helpers")
    assert task.solution is None and task.solution_refusal is None
    assert [c for c, _ in task.solution_commands][0] == "cd /tmp && export LINES_FILE=/app/out.txt"
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("task.yaml", "run-tests.sh"):
        (keys / name).write_text((FIXTURES / "tb1-uv-helpers" / name).read_text())
    (keys / "solution.yaml").write_text("- command: vim notes.txt\n  block: false\n- command: ihello\n"
                                        "  append_enter: false\n- command: Escape\n")
    refused = load_task(keys)
    assert not refused.solution_commands and "keystroke" in refused.solution_refusal


def test_short_errors_name_the_task_not_its_path():
    error = ("task /work/tb-tasks/hello-world: base image 'x' is missing at /work/tb-tasks/hello-world/Dockerfile; "
             + "more " * 100)
    short = short_error(error)
    assert "/work/tb-tasks" not in short and short.startswith("base image") and len(short) <= 160


def test_auto_sandbox_keeps_local_for_the_shipped_tasks(tmp_path):
    assert choose_sandbox("auto", SHIPPED) == ("local", "")
    assert choose_sandbox("local", tmp_path) == ("local", "")


# ------------------------------------------------------------------------------ real containers


def test_compose_sidecars_are_parsed(tmp_path):
    task = load_task(FIXTURES / "tb2-sidecar")
    [kv] = task.services
    assert kv.name == "kv" and kv.context_dir == (FIXTURES / "tb2-sidecar" / "environment" / "kv").resolve()
    assert kv.dockerfile.name == "Dockerfile" and kv.environment == (("KV_SECRET", "sidecar-7f3a"),)
    assert kv.healthcheck[:2] == ("python3", "-c") and kv.wait_healthy
    assert (kv.health_interval_s, kv.health_retries, kv.health_start_period_s) == (1.0, 20, 2.0)
    assert "2 services" in task.local_refusal

    folder = tmp_path / "tb1-db"  # TB1 names the agent's service `client`
    folder.mkdir()
    (folder / "task.yaml").write_text("instruction: x\n")
    (folder / "Dockerfile").write_text("FROM python:3.13-slim-bookworm\nWORKDIR /app\n")
    (folder / "run-tests.sh").write_text("true\n")
    (folder / "docker-compose.yaml").write_text(
        "services:\n  client:\n    build: {dockerfile: Dockerfile}\n    environment:\n"
        "      - TEST_DIR=${T_BENCH_TEST_DIR}\n      - MODE=ci\n"
        "  db:\n    image: postgres:16\n    command: postgres -c fsync=off\n"
        "    healthcheck: {test: [CMD-SHELL, pg_isready], interval: 1m30s}\n")
    task = load_task(folder)
    [db] = task.services
    assert (db.image, db.command, db.healthcheck) == ("postgres:16", ("sh", "-c", "postgres -c fsync=off"),
                                                      ("sh", "-c", "pg_isready"))
    assert db.health_interval_s == 90.0 and not db.wait_healthy  # no depends_on condition: not awaited
    assert task.compose_env == {"TEST_DIR": "/tests", "MODE": "ci"}  # the TB1 harness's ${T_BENCH_TEST_DIR}

    (folder / "docker-compose.yaml").write_text("services:\n  app:\n    build: .\n  db:\n    image: postgres:16\n")
    with pytest.raises(TaskError, match="none is the agent's"):
        load_task(folder)

    # TB1 simple-web-scraper style: the agent's image and the server's each from their own folder
    (folder / "Dockerfile").unlink()
    for sub in ("client", "server"):
        (folder / sub).mkdir()
        (folder / sub / "Dockerfile").write_text(f"FROM python:3.13-slim-bookworm\nRUN echo {sub} > /role\n")
    (folder / "docker-compose.yaml").write_text(
        "services:\n  client:\n    build: {context: client, dockerfile: Dockerfile}\n"
        "    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}\n"
        "  server:\n    build: {context: server}\n    image: ${T_BENCH_TASK_DOCKER_NAME_PREFIX}__server\n")
    task = load_task(folder)
    assert task.dockerfile == (folder / "client" / "Dockerfile").resolve() and task.context_dir == (folder / "client").resolve()
    assert task.docker_image == "python:3.13-slim-bookworm"
    [server] = task.services
    assert server.dockerfile == (folder / "server" / "Dockerfile").resolve() and server.image == ""


def _box(tmp_path: Path, **limits) -> ContainerSandbox:
    spec = SandboxSpec(episode_dir=tmp_path, command_timeout_s=10.0, docker_image=base_image(),
                       limits=SandboxLimits(**{"max_processes": 32, "memory_mb": 128, "cpu_time_s": 5, **limits}))
    box = ContainerSandbox(spec)
    box.start()
    return box


@pytest.mark.container
def test_fork_beyond_the_process_limit_gets_eagain_and_the_command_goes_on(tmp_path):
    box = _box(tmp_path)
    try:
        forker = ("import errno, os, time\nkids = []\ntry:\n    for _ in range(100):\n        pid = os.fork()\n"
                  "        if pid == 0:\n            time.sleep(5)\n            os._exit(0)\n        kids.append(pid)\n"
                  "except OSError as exc:\n    print('fork failed:', errno.errorcode[exc.errno], 'after', len(kids))\n"
                  "for kid in kids:\n    os.kill(kid, 9)\n")
        result = box.exec(f"python3 -c {shlex.quote(forker)}; echo survived", timeout_s=30)
        assert "fork failed: EAGAIN after" in result.output, result.output
        assert "survived" in result.output and not result.timed_out and result.exit_code == 0
        assert "processes" in result.refused and "process limit (32) reached" in result.output
        assert box.exec("echo ok").output == "ok\n"
    finally:
        box.close()


@pytest.mark.container
def test_task_image_is_rebuilt_when_its_base_image_changes(tmp_path):
    """The cache key covers the image ID ``FROM`` resolves to: a re-bootstrapped stand-in (or a
    pulled real image) under the same name must not leave tasks on the old one."""
    base = base_image()
    engine = resolve_engine()
    ref = f"localhost/t1async-test/rebase-{os.getpid()}:latest"
    (tmp_path / "Dockerfile").write_text(f"FROM {ref}\nRUN echo built > /built.txt\n")
    built: list[str] = []
    try:
        engine.run("tag", base, ref)
        built.append(ensure_task_image(engine, name="rebase", dockerfile=tmp_path / "Dockerfile", context_dir=tmp_path))
        assert ensure_task_image(engine, name="rebase", dockerfile=tmp_path / "Dockerfile", context_dir=tmp_path) == built[0]
        engine.run("tag", built[0], ref)  # the same name now resolves to another image
        built.append(ensure_task_image(engine, name="rebase", dockerfile=tmp_path / "Dockerfile", context_dir=tmp_path))
        assert built[1] != built[0]
    finally:
        engine.run("rmi", ref, *built, check=False)


@pytest.mark.container
def test_pip_may_replace_the_stand_ins_preinstalled_packages(tmp_path):
    """In the official python images every preinstalled distribution came from pip, so a task's
    ``pip install`` may upgrade one (mlflow pulls a newer ``packaging``); the Debian stand-in's
    must be as removable (offline here: an uninstall is what an upgrade does first)."""
    box = _box(tmp_path, max_processes=64, memory_mb=256, cpu_time_s=30)
    try:
        result = box.exec("pip uninstall -y packaging 2>&1; python3 -c 'import packaging' 2>&1 | tail -1", timeout_s=60)
        assert "Successfully uninstalled packaging" in result.output, result.output
        assert "No module named 'packaging'" in result.output, result.output
    finally:
        box.close()


@pytest.mark.container
def test_escapes_are_contained(tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("do not read\n")
    victim = subprocess.Popen(["sleep", str(random.randrange(10**6, 10**7))])
    box = _box(tmp_path / "box")
    name = box.name
    try:
        for probe in (f"cat {secret}", "ls /work", "cat /proc/1/root/etc/shadow"):
            result = box.exec(probe)
            assert "do not read" not in result.output and (result.exit_code != 0 or probe.endswith("shadow")), probe
        assert box.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").output.split() == ["lo"]
        assert box.exec(f"kill -9 {victim.pid}").exit_code != 0
        box.exec("kill -9 -1 2>/dev/null; true")
        time.sleep(0.2)
        assert victim.poll() is None, "a host process was killed from inside the container"
        bomb = box.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout_s=2.0)
        assert bomb.timed_out and "processes" in bomb.refused
        memory = box.exec("python3 -c 'x = bytearray(400 << 20); print(len(x))'", timeout_s=20)
        assert memory.exit_code != 0 and "memory" in memory.refused, memory.output
        box.exec("nohup sleep 12345 >/dev/null 2>&1 & setsid sleep 12346 &")
    finally:
        box.close()
        victim.kill()
        victim.wait()
    left = subprocess.run(["podman", "ps", "-a", "--filter", f"name={name}", "--format", "{{.Names}}"],
                          capture_output=True, text=True)
    assert left.stdout.strip() == "", "the container outlived close()"
    assert subprocess.run(["pgrep", "-f", "sleep 1234[56]"], capture_output=True).stdout == b""


@pytest.mark.container
@pytest.mark.parametrize("name", ["tb2-fidelity", "tb1-uv-helpers", "tb2-sidecar"])
def test_fidelity_fixtures_resolve_with_the_oracle_and_not_without(name, tmp_path):
    base_image()
    task = load_task(FIXTURES / name)
    report = validate_task(task, tmp_path, sandbox="container")
    assert report.error is None, report.error
    tests = {"tb2-fidelity": 3, "tb1-uv-helpers": 2, "tb2-sidecar": 1}[name]
    assert report.oracle.resolved and report.oracle.total == tests, report.oracle.output
    assert not report.noop.resolved


@pytest.mark.container
def test_sidecars_are_removed_with_the_sandbox(tmp_path):
    base_image()
    task = load_task(FIXTURES / "tb2-sidecar")
    with TerminalEnv(task, root=tmp_path / "episodes", sandbox="container", command_timeout_s=60) as env:
        env.reset()
        box = env.sandbox
        names = [box.name, *box._services]
        assert len(names) == 2
        assert "sidecar-7f3a" in box.exec("python3 -c \"import urllib.request; "
                                           "print(urllib.request.urlopen('http://kv:8080/secret').read())\"").output
    engine = box.engine
    left = engine.run("ps", "-a", "--format", "{{.Names}}", check=False).stdout.decode().split()
    assert not set(names) & set(left)


@pytest.mark.container
def test_shipped_task_resolves_in_a_container_and_logs_its_commands(tmp_path):
    base_image()
    task = load_task(SHIPPED / "zip-find-token")
    with TerminalEnv(task, root=tmp_path / "episodes", sandbox="container", command_timeout_s=60,
                     log_dir=tmp_path / "logs") as env:
        env.reset()
        env.run_solution()
        verdict = env.verify()
    assert verdict.resolved, verdict.output
    log = (tmp_path / "logs" / "commands.log").read_text()
    assert "### oracle (exit 0" in log and "### verifier" in log
    build = (tmp_path / "logs" / "build.log").read_text()
    assert "zip-find-token" in build and ("FROM" in build or "found in the cache" in build)


_OWNER = """
import os, sys, time
from pathlib import Path
from t1async.envs.sandboxes.container import ContainerSandbox, remove_orphan_containers
from t1async.envs.protocol import SandboxSpec
box = ContainerSandbox(SandboxSpec(episode_dir=Path(sys.argv[1]), command_timeout_s=10.0, docker_image=sys.argv[2]))
box.start()
print(box.name, flush=True)
time.sleep(600)
"""


@pytest.mark.container
def test_containers_of_a_killed_owner_are_removed_and_a_live_owners_kept(tmp_path):
    """Issue 29, item 5: SIGKILL of the process that owns an episode leaves its container running;
    :func:`remove_orphan_containers` (run at actor start, by the reaper and by a new launch)
    removes it, and leaves alone a container whose owner is alive or that lies elsewhere."""
    base = base_image()
    engine = resolve_engine()
    root = tmp_path / "workspaces"
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(root / "t1async-rollout0-x" / "ep1"), base],
                             stdout=subprocess.PIPE, text=True)
    dead_name = owner.stdout.readline().strip()
    live = _box(root / "t1async-rollout1-y" / "ep1")  # owned by this (live) test process
    elsewhere = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path / "other-run" / "ep1"), base],
                                 stdout=subprocess.PIPE, text=True)
    elsewhere_name = elsewhere.stdout.readline().strip()
    try:
        owner.kill()
        owner.wait(10)
        elsewhere.kill()
        elsewhere.wait(10)

        def running() -> set[str]:
            out = engine.run("ps", "--filter", "label=t1async.sandbox=1", "--format", "{{.Names}}", check=False)
            return set(out.stdout.decode().split())

        assert dead_name in running()  # the leak: the container outlives its owner
        assert remove_orphan_containers(root) == [dead_name]
        assert dead_name not in running() and live.name in running() and elsewhere_name in running()
        assert remove_orphan_containers(root) == []  # idempotent; the live owner's stays
    finally:
        live.close()
        remove_orphan_containers(tmp_path)
    assert elsewhere_name not in running()
