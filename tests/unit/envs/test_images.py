"""Stand-in images (``t1async images bootstrap``): name normalisation, the chain each stand-in is
built from, build-failure summaries and the CLI's exit status (no engine needed), and, marked
``container``, what a stand-in's image config and userland look like from inside."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from t1async.commands import env_cli as envs_cli
from t1async.envs.images import stand_ins
from t1async.envs.images.engine import BuildError, resolve_engine, summarise_build_failure
from t1async.envs.images.stand_ins import chain, normalise, qualified, rootfs_tag, stand_in_for
from t1async.envs.images.task_images import ensure_task_image
from t1async.envs.taskio.dockerfile import dockerfile_instructions, from_images, rewrite_from

DIGEST = "@sha256:" + "ab" * 32


# --------------------------------------------------------------------------------- names (issue 26, defect 3)


@pytest.mark.parametrize("ref, short", [
    ("debian:bookworm-slim", "debian:bookworm-slim"),
    (f"public.ecr.aws/docker/library/debian:bookworm-slim{DIGEST}", "debian:bookworm-slim"),
    ("mirror.gcr.io/library/python:3.13-slim-bookworm", "python:3.13-slim-bookworm"),
    ("mirror.gcr.io/ubuntu:24.04", "ubuntu:24.04"),
    ("registry-1.docker.io/library/ubuntu:22.04", "ubuntu:22.04"),
    ("index.docker.io/library/debian", "debian:latest"),
    ("docker.io/library/python:3.11", "python:3.11"),
    ("Docker.IO/library/python:3.11", "python:3.11"),
    (f"debian:bookworm{DIGEST}", "debian:bookworm"),
    (f"debian{DIGEST}", "debian:latest"),
    ("docker.io/someone/tool", "someone/tool:latest"),
    ("localhost:5000/team/img:1", "localhost:5000/team/img:1"),
    (f"ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest{DIGEST}", "ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest"),
    ("public.ecr.aws/someone/tool:1", "public.ecr.aws/someone/tool:1"),  # not the official library: host kept
])
def test_normalise_understands_mirrors_of_the_official_library_and_digests(ref, short):
    assert normalise(ref) == short


def test_mirror_and_digest_names_get_the_stand_in_of_the_plain_name():
    for ref in (f"public.ecr.aws/docker/library/debian:bookworm-slim{DIGEST}", "mirror.gcr.io/library/debian:bookworm-slim",
                "registry-1.docker.io/library/debian:bookworm-slim", "docker.io/debian:bookworm-slim"):
        assert stand_in_for(ref) is stand_in_for("debian:bookworm-slim") is not None, ref
        assert qualified(ref) == "docker.io/library/debian:bookworm-slim"
    assert stand_in_for("public.ecr.aws/someone/debian:bookworm") is None
    assert qualified(f"ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest{DIGEST}") == \
        "ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest"


def test_from_lines_are_pointed_at_the_local_name():
    ref = f"public.ecr.aws/docker/library/debian:bookworm-slim{DIGEST}"
    text = f"FROM --platform=linux/amd64 {ref} AS base\nRUN echo {ref}\nFROM base\nFROM python:3.11\n"
    out = rewrite_from(text, {ref: qualified(ref)})
    assert out.splitlines()[0] == "FROM --platform=linux/amd64 docker.io/library/debian:bookworm-slim AS base"
    assert out.splitlines()[1:] == text.splitlines()[1:]  # RUN text and other FROMs untouched
    assert from_images(out) == ["docker.io/library/debian:bookworm-slim", "python:3.11"]


# --------------------------------------------------------------------------------- which image stands in (1, 7)


@pytest.mark.parametrize("ref, suite, python, workdir", [
    ("python:3.13-slim-bookworm", "bookworm", "3.13", ""),
    ("python:3.13-bookworm", "bookworm", "3.13", ""),
    ("python:3.13-slim", "trixie", "", ""),  # the official one is trixie-based now
    ("python:3.11-slim-bookworm", "bookworm", "", ""),
    ("python:3.9-slim-bookworm", "bullseye", "", ""),  # the Python version first: bullseye's 3.9
    ("python:3.8-slim-bookworm", "bullseye", "", ""),
    ("python:3.10-slim", "bookworm", "", ""),          # 3.11: the nearest at or above 3.10
    ("debian:bookworm", "bookworm", "", ""),
    ("debian:trixie-slim", "trixie", "", ""),
    ("ubuntu:24.04", "trixie", "", ""),
    ("debian:bullseye-slim", "bullseye", "", ""),
    ("python:3.9-slim-bullseye", "bullseye", "", ""),
    ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", "bookworm", "3.13", "/app"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624", "trixie", "", "/app"),
])
def test_stand_ins_follow_the_official_images_release_and_config(ref, suite, python, workdir):
    rule = stand_in_for(ref)
    assert (rule.suite, rule.python, rule.workdir) == (suite, python, workdir)
    assert rule.differences


def test_tb1_bases_get_their_own_layer_on_a_shared_chain():
    tb1 = chain(stand_in_for("ghcr.io/laude-institute/t-bench/python-3-13:20250620"))
    plain = chain(stand_in_for("python:3.13-slim-bookworm"))
    assert [kind for kind, _ in tb1] == ["rootfs", "python", "config"]
    assert tb1[:2] == plain  # the CPython build is shared
    assert rootfs_tag(stand_in_for("debian:bookworm")) != rootfs_tag(stand_in_for("ghcr.io/laude-institute/t-bench/"
                                                                                  "python-3-13:latest"))
    assert all(tag.endswith(f":{stand_ins.ROOTFS_VERSION}") for _, tag in tb1)
    assert stand_ins.ROOTFS_VERSION >= 3  # older bootstraps (no /app, trixie for bookworm names) are replaced


def test_root_filesystems_keep_the_updates_and_security_archives():
    assert stand_ins.apt_sources("bookworm") == [
        "deb http://deb.debian.org/debian bookworm main", "deb http://deb.debian.org/debian bookworm-updates main",
        "deb http://deb.debian.org/debian-security bookworm-security main"]
    assert stand_ins.apt_sources("trixie", "http://mirror.example/debian") == ["http://mirror.example/debian"]


def test_layers_say_what_the_official_images_do():
    config = stand_ins.config_layer_dockerfile("P", stand_in_for("ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest"))
    assert "tmux asciinema python3-setuptools fonts-dejavu-core" in config and "WORKDIR /app" in config.splitlines()
    py = stand_ins.python_layer_dockerfile("P", "3.13")
    assert "apt-get source --download-only -qq python3.13" in py and "--enable-shared" in py
    assert py.splitlines()[0] == "FROM P"


def test_no_stand_in_ships_a_file_the_official_images_lack_on_path(monkeypatch, tmp_path):
    """Issue 41 item 1: no official image has /usr/bin/python (python-is-python3), and every
    terminal-bench-env Dockerfile runs ``ln -s /usr/bin/python3 /usr/bin/python``, which then
    fails with "File exists". The root filesystem's package list (read from the mmdebstrap call
    itself) leaves the package out; Ubuntu names get the official image's ``ubuntu`` user."""
    argv = []

    class Done:
        returncode, stdout, stderr = 1, b"", b"E: stop here"

    monkeypatch.setattr(stand_ins.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(stand_ins.subprocess, "run", lambda a, **kw: argv.append(a) or Done())
    monkeypatch.setattr(stand_ins, "CACHE_DIR", tmp_path)
    for ref in ("ubuntu:24.04", "python:3.13-slim", "debian:bookworm", "ghcr.io/laude-institute/t-bench/ubuntu-24-04:x"):
        with pytest.raises(BuildError):
            stand_ins.build_rootfs(None, stand_in_for(ref))
    includes = [next(a for a in call if a.startswith("--include=")) for call in argv]
    assert all("python3-pip" in inc and "python-is-python3" not in inc for inc in includes), includes
    for ref in ("ubuntu:24.04", "ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624"):
        layer = stand_ins.config_layer_dockerfile("P", stand_in_for(ref))
        assert "RUN groupadd -g 1000 ubuntu && useradd -m -u 1000 -g 1000 -s /bin/bash ubuntu" in layer
    assert not stand_in_for("debian:bookworm").users and not stand_in_for("python:3.13-slim").users
    assert chain(stand_in_for("ubuntu:24.04"))[0] == chain(stand_in_for("python:3.13-slim"))[0]  # one root filesystem


# --------------------------------------------------------------------------------- build failures (10)


DOCKERFILE = """FROM python:3.13-slim-bookworm
# a comment
WORKDIR /app
RUN apt-get update && \\
    apt-get install -y nosuchpkg
COPY <<EOF /app/x.txt
hello
EOF
RUN echo done
"""

PODMAN_OUTPUT = (
    "STEP 1/5: FROM python:3.13-slim-bookworm\nSTEP 2/5: WORKDIR /app\n--> abc\n"
    "STEP 3/5: RUN apt-get update &&     apt-get install -y nosuchpkg\r\n"
    "Get:1 http://deb.debian.org/debian bookworm InRelease [151 kB]\r\n"
    "Reading package lists...\r\nW: some warning\r\nE: Unable to locate package nosuchpkg\r\n"
    "Error: error building at STEP \"RUN apt-get update &&     apt-get install -y nosuchpkg\": "
    "error while running runtime: exit status 100\n"
)


def test_dockerfile_instructions_number_stages_and_lines():
    stages = dockerfile_instructions("ARG X=1\n" + DOCKERFILE + "FROM debian AS two\nRUN false\n")
    assert [line for line, _ in stages[0]] == [2, 4, 5, 7, 10]
    assert stages[0][2][1] == "RUN apt-get update && apt-get install -y nosuchpkg"
    assert stages[1] == [(11, "FROM debian AS two"), (12, "RUN false")]


def test_build_failure_names_the_step_its_line_and_the_first_error():
    summary = summarise_build_failure(DOCKERFILE, PODMAN_OUTPUT)
    assert summary == ("step 3/5 (Dockerfile line 4: RUN apt-get update && apt-get install -y nosuchpkg): "
                       "E: Unable to locate package nosuchpkg")
    assert "\\r" not in summary and "\r" not in summary
    multi = "[2/2] STEP 2/2: RUN false\nError: error building at STEP \"RUN false\": exit status 1\n"
    assert summarise_build_failure("FROM a AS b\nFROM b\nRUN false\n", multi) == \
        'step 2/2 (Dockerfile line 3: RUN false): Error: error building at STEP "RUN false": exit status 1'
    assert summarise_build_failure("", "") == "no output"


def test_build_error_message_is_one_line_with_the_log(monkeypatch, tmp_path):
    class FakeEngine:
        name = "podman"
        cfg = stand_ins.Engine("podman", ["podman"]).cfg

        def ulimits(self):
            return []

        def run(self, *args, stdout=None, **kwargs):
            stdout.write(PODMAN_OUTPUT.encode())
            return type("Done", (), {"returncode": 125})()

    monkeypatch.setattr("t1async.envs.images.engine.CACHE_DIR", tmp_path)
    with pytest.raises(BuildError) as caught:
        stand_ins._build(FakeEngine(), "localhost/x:1", DOCKERFILE, None, {}, None)
    message = str(caught.value)
    assert "\n" not in message and "\\r\\n" not in message
    assert "step 3/5 (Dockerfile line 4: RUN apt-get update" in message
    assert "E: Unable to locate package nosuchpkg" in message
    log = Path(message.rsplit("(full log: ", 1)[1].rstrip(")"))
    assert "Get:1 http://deb.debian.org" in log.read_text()


# --------------------------------------------------------------------------------- the CLI's exit status (3)


def test_bootstrap_exits_non_zero_naming_each_image_without_a_stand_in(monkeypatch, tmp_path, capsys):
    for name, image in (("uses-alpine", "alpine:3.20"), ("uses-debian", "debian:bookworm"), ("uses-node", "node:20")):
        folder = tmp_path / name
        (folder / "tests").mkdir(parents=True)
        (folder / "task.yaml").write_text("instruction: do it\n")
        (folder / "Dockerfile").write_text(f"FROM {image}\n")
        (folder / "run-tests.sh").write_text("#!/bin/sh\nexit 0\n")
        (folder / "tests" / "test_outputs.py").write_text("def test_x():\n    pass\n")
    done: list[list[str]] = []

    class FakeEngine:
        name = "podman"

        def image_exists(self, ref):
            return False

    def fake_bootstrap(engine, names, rebuild=False):
        done.append(list(names))
        report = stand_ins.BootstrapReport()
        for ref in names:
            if stand_in_for(ref):
                report.tagged[ref] = (rootfs_tag(stand_in_for(ref)), "x")
            else:
                report.unknown.append(ref)
        return report

    monkeypatch.setattr(envs_cli, "resolve_engine", lambda cfg=None: FakeEngine())
    monkeypatch.setattr(envs_cli, "bootstrap", fake_bootstrap)
    args = argparse.Namespace(config=None, name=["debian:trixie"], tasks=str(tmp_path), rebuild=False)
    assert envs_cli.run_images(args) == 1
    err = capsys.readouterr().err
    assert "no stand-in for alpine:3.20 (used by uses-alpine)" in err
    assert "no stand-in for node:20 (used by uses-node)" in err
    assert "debian:bookworm" in done[0] and "debian:trixie" in done[0]  # the others were still done


# --------------------------------------------------------------------------------- inside the stand-ins


def _podman_or_skip():
    import shutil

    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    return resolve_engine()


@pytest.mark.container
def test_tb1_base_has_app_as_its_workdir_and_userland_matches(tmp_path):
    """Defects 1 and 7: ``COPY data.txt /app`` lands in the folder /app, ``COPY x ./`` in /app,
    and the config layer adds tmux and keeps the man folders (the python-3-13 base: see below)."""
    engine = _podman_or_skip()
    ref = "ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624"
    stand_ins.bootstrap(engine, [ref], describe_images=False)
    (tmp_path / "data.txt").write_text("payload\n")
    (tmp_path / "x").write_text("x\n")
    (tmp_path / "Dockerfile").write_text(f"FROM {ref}{DIGEST}\nCOPY data.txt /app\nCOPY x ./\n"
                                         "RUN test -f /app/data.txt && test -f /app/x && [ \"$(pwd)\" = /app ] "
                                         "&& command -v tmux && test -d /usr/share/man/man1 "
                                         # setuptools whole, not the empty namespace trixie's asciinema leaves
                                         "&& python3 -c 'import setuptools; setuptools.setup'\n")
    tag = ensure_task_image(engine, name="tb1-app", dockerfile=tmp_path / "Dockerfile", context_dir=tmp_path)
    try:
        assert engine.image_config(tag).get("WorkingDir") == "/app"
        assert not (engine.image_config("docker.io/library/ubuntu:24.04").get("WorkingDir") or "")
    finally:
        engine.run("rmi", tag, check=False)


@pytest.mark.container
@pytest.mark.slow
def test_python_313_bookworm_stand_in_is_python_org_style():
    """Defect 7's hard case: CPython 3.13 in /usr/local on bookworm (OpenSSL 3.0), pip and venv
    working. Builds CPython on first use (minutes), hence slow."""
    engine = _podman_or_skip()
    ref = "python:3.13-slim-bookworm"
    stand_ins.bootstrap(engine, [ref], describe_images=False)
    script = ("set -e; readlink -f \"$(command -v python3)\"; python --version; pip --version; "
              "python3 -m venv /tmp/v && /tmp/v/bin/python -c 'import ssl, sqlite3, ctypes, lzma, bz2, readline, uuid; "
              "print(ssl.OPENSSL_VERSION)'; . /etc/os-release; echo $VERSION_CODENAME")
    done = engine.run("run", "--rm", "--network", "none", *engine.ulimits(), qualified(ref), "sh", "-c", script,
                      timeout_s=120)
    out = done.stdout.decode()
    assert "/usr/local/bin/python3.13" in out and "Python 3.13." in out and "OpenSSL 3.0." in out, out
    assert out.strip().endswith("bookworm"), out
    assert os.path.basename(out.splitlines()[0]) == "python3.13"


CHECKS = {
    # name: a shell test of what the official image has, run inside a build of the stand-in
    "python:3.13-slim": '[ "$(command -v python)" = /usr/local/bin/python ] && [ "$(id -un)" = root ] '
                        '&& ! getent passwd 1000 && [ "$(pwd)" = / ]',
    "ubuntu:24.04": '[ "$(id -u ubuntu):$(id -g ubuntu)" = 1000:1000 ] && [ -d /home/ubuntu ] '
                    '&& [ "$(getent passwd ubuntu | cut -d: -f7)" = /bin/bash ] && [ "$(pwd)" = / ]',
    "ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624": '[ "$(id -u ubuntu)" = 1000 ] && [ "$(pwd)" = /app ] '
                                                            '&& command -v tmux',
}


@pytest.mark.container
@pytest.mark.parametrize("ref", sorted(CHECKS))
def test_dockerfiles_written_for_the_official_images_build_on_the_stand_ins(tmp_path, ref):
    """Issue 41 item 1, from inside: the line every terminal-bench-env Dockerfile has
    (``ln -s /usr/bin/python3 /usr/bin/python``, "File exists" where python-is-python3 is) builds,
    and the users, PATH and WORKDIR are the official image's."""
    engine = _podman_or_skip()
    stand_ins.bootstrap(engine, [ref], describe_images=False)
    (tmp_path / "Dockerfile").write_text(f"FROM {ref}\nRUN ! test -e /usr/bin/python && {CHECKS[ref]}\n"
                                         "RUN ln -s /usr/bin/python3 /usr/bin/python && python --version\n")
    tag = ensure_task_image(engine, name="official-contents", dockerfile=tmp_path / "Dockerfile", context_dir=tmp_path)
    engine.run("rmi", tag, check=False)
