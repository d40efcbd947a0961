"""Offline stand-ins for the base images tasks name in ``FROM`` (split from :mod:`.images`, which
re-exports every public name here).

With no registry reachable, ``t1async images bootstrap`` builds each stand-in locally and tags it
under the names tasks use. A stand-in is a chain of at most three local images, each tagged under
:data:`BASE_REPO` and shared by the stand-ins that need it:

1. **root filesystem** (:func:`build_rootfs`): ``mmdebstrap --variant=minbase`` of the Debian
   release the official image is built on (``python:3.13-slim-bookworm`` and the Terminal-Bench 1
   ``python-3-13`` base: bookworm), with ca-certificates, procps, netbase and, unless CPython is
   built in step 2, Debian's python3, pip and venv (pip may install system-wide: the
   ``EXTERNALLY-MANAGED`` marker is removed, as the official python images have none;
   ``python``/``pip`` links in ``/usr/local/bin``). Documentation is dropped as in Debian's slim
   images, but the ``/usr/share/man/man1..8`` folders are kept (``default-jre``'s
   update-alternatives and ``man-db`` fail without them).
2. **CPython** (:func:`python_layer_dockerfile`, only where :attr:`StandIn.python` is set): the
   official python images build python.org's CPython into ``/usr/local`` on a Debian userland
   that has another Python; here the same is done from Debian's ``python3.13`` source package
   (trixie's, fetched with ``apt-get source``: the orig tarball is python.org's release,
   signature-checked by apt), on bookworm: ``/usr/local/bin/python3.13`` with ``python3``,
   ``python``, ``pip``, ``pip3`` links, pip from ``ensurepip``, the build tools purged again.
3. **image config layer** (:func:`config_layer_dockerfile`, where :attr:`StandIn.packages` or
   :attr:`StandIn.workdir` is set): what a derived official image adds, e.g. the Terminal-Bench 1
   bases' ``tmux``/``asciinema`` and ``WORKDIR /app``.

Every substitution is reported (:attr:`StandIn.differences`, docs/images.md). Measured here (two
CPU cores shared): a root filesystem 40-120 s, about 130-200 MB; the CPython layer about
6-10 min once; the config layer 20-40 s.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from ..protocol import SandboxError, SandboxUnavailable
from .engine import CACHE_DIR, DEBIAN_MIRROR, BuildError, Engine, _build, _build_lock

BASE_REPO = "localhost/t1async-base"
"""Repository of the stand-in images (``<BASE_REPO>/<chain name>:<ROOTFS_VERSION>``)."""

ROOTFS_VERSION = 5
"""Bumped whenever a stand-in changes (2: pip ``RECORD`` files for Debian's Python packages; 4:
per-image Debian release, CPython built into ``/usr/local``, ``WORKDIR /app`` for the
Terminal-Bench 1 bases, man folders kept, updates and security archives, no apt cache; 5: no
``python-is-python3`` (no ``/usr/bin/python``), the ``ubuntu`` user of the Ubuntu names), so that
``t1async images bootstrap`` builds and re-tags anew (older stand-ins are recognised and replaced; pulled images are left alone)."""

BASE_PACKAGES = ("ca-certificates", "procps", "netbase")
"""Packages every stand-in root filesystem gets on top of ``minbase``."""

DEBIAN_PYTHON_PACKAGES = ("python3", "python3-pip", "python3-venv")
"""Added to root filesystems whose stand-in takes Debian's own Python (:attr:`StandIn.python` empty).
Not ``python-is-python3``: no official image has ``/usr/bin/python`` (the python images have
``/usr/local/bin/python``, Debian and Ubuntu none), and Dockerfiles create it themselves
(``RUN ln -s /usr/bin/python3 /usr/bin/python``, which fails with "File exists" where it is)."""

UBUNTU_USERS = (("ubuntu", 1000),)
"""Users the official ``ubuntu:24.04`` image has beyond Debian's system users: ``ubuntu``, uid and
gid 1000, home ``/home/ubuntu``, shell bash (so a Dockerfile's ``useradd -u 1000`` fails there
and a plain ``useradd`` gets 1001, as on the official image)."""

BOOTSTRAP_PACKAGES = BASE_PACKAGES + DEBIAN_PYTHON_PACKAGES
"""Every package of a Debian-Python root filesystem beyond ``minbase`` (kept for callers)."""

PYTHON_SOURCE_SUITE = "trixie"
"""Debian release whose ``python3.<minor>`` source package CPython layers are built from."""

PYTHON_BUILD_DEPS = ("dpkg-dev", "gcc", "make", "pkg-config", "libc6-dev", "libbz2-dev", "libffi-dev", "libgdbm-dev",
                     "liblzma-dev", "libncurses-dev", "libreadline-dev", "libsqlite3-dev", "libssl-dev", "uuid-dev",
                     "xz-utils", "zlib1g-dev")
"""Debian packages the CPython layer builds with (purged afterwards; the shared libraries its
modules link are kept)."""

PYTHON_BUILD_TIMEOUT_S = 3600.0
"""Limit on the CPython layer's build (measured: 6-10 min on two shared cores)."""

PIP_RECORDS_SCRIPT = r"""
import os, re, sys
root = sys.argv[1]
info = os.path.join(root, "var/lib/dpkg/info")
meta = re.compile(r"(/usr/lib/python3[^/]*/dist-packages)/([^/]+\.(dist-info|egg-info))")
for name in sorted(os.listdir(info)):
    if not name.endswith(".list"):
        continue
    with open(os.path.join(info, name)) as handle:
        owned = [line.rstrip("\n") for line in handle if line.strip()]
    for entry in owned:
        match = meta.fullmatch(entry)
        if not match or not os.path.isdir(root + entry):
            continue
        site, kind = match.group(1), match.group(3)
        files = [q for q in owned if q.startswith(site + "/") and os.path.isfile(root + q)]
        if kind == "dist-info" and not os.path.exists(root + entry + "/RECORD"):
            lines = [os.path.relpath(q, site) + ",," for q in files] + [os.path.relpath(entry, site) + "/RECORD,,"]
            with open(root + entry + "/RECORD", "w") as out:
                out.write("\n".join(lines) + "\n")
        elif kind == "egg-info" and not os.path.exists(root + entry + "/installed-files.txt"):
            with open(root + entry + "/installed-files.txt", "w") as out:
                out.write("\n".join(os.path.relpath(q, entry) for q in files) + "\n")
"""
"""Customize hook (host Python, the root filesystem as argv[1]): give every Python distribution a
Debian package installed (pip, wheel, packaging; setuptools on bookworm) the file list pip needs
to uninstall it (``RECORD`` / ``installed-files.txt``, from dpkg's own list of the package's
files under dist-packages). In the official python images every preinstalled distribution was
installed by pip, so ``pip install mlflow`` may upgrade ``packaging``; without these lists pip
stops with "Cannot uninstall packaging: no RECORD file was found ... installed by debian"."""


APT_CLEAN_CONF = """# no package cache in the image (as in the official Debian images' file of this name)
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
"""
"""``/etc/apt/apt.conf.d/docker-clean`` of every stand-in: downloaded packages are deleted after
each install, as in the official images (tasks that want the cache delete this file)."""


@dataclass(frozen=True)
class StandIn:
    """A locally built image that stands in for a registry image.

    Attributes:
        pattern: regular expression over the normalised image reference (:func:`normalise`:
            ``repo:tag``, registry mirrors of Docker's official library and digests removed).
        suite: Debian release of the root filesystem (``bookworm``, ``trixie``): the one the
            official image is built on where that is Debian.
        python: ``""``: Debian's own python3 of ``suite`` (in ``/usr/bin``); ``"3.13"``: CPython
            built from Debian's ``python3.13`` source into ``/usr/local``, as python.org images have.
        packages: Debian packages the official image adds on top (installed in the config layer).
        workdir: the official image's ``WorkingDir`` ("" when it sets none).
        users: ``(name, uid)`` of the users the official image adds (group of the same name and
            id, home in ``/home``, shell bash), created in the config layer.
        differences: what differs from the official image, for the report.
    """

    pattern: str
    suite: str
    python: str = ""
    packages: tuple[str, ...] = ()
    workdir: str = ""
    differences: str = ""
    users: tuple[tuple[str, int], ...] = ()


_DEB = "Debian {} minbase plus python3, pip, venv, ca-certificates, procps, netbase; no documentation (as -slim)"
_PYORG = ("CPython {} built from source into /usr/local on {} like python.org's image, without PGO/LTO "
          "(slower, same behaviour); plus procps")
_TB1 = "; tmux and asciinema from apt, WORKDIR /app, as the Terminal-Bench 1 base image"
STAND_INS: tuple[StandIn, ...] = (
    StandIn(r"python:3\.13(?:[.\d]*)(?:-slim)?-bookworm", "bookworm", python="3.13",
            differences=_PYORG.format("3.13", "Debian 12 bookworm")),
    StandIn(r"python:3\.13(?:[.\d]*)(?:-slim)?(?:-trixie)?", "trixie",
            differences="Debian trixie's Python 3.13 (/usr/bin, Debian pip) instead of python.org's build in "
                        "/usr/local, on the same Debian 13 trixie userland"),
    StandIn(r"python:3\.11(?:[.\d]*)(?:-slim)?(?:-bookworm)?", "bookworm",
            differences="Debian bookworm's Python 3.11 (/usr/bin, Debian pip) instead of python.org's in /usr/local"),
    StandIn(r"python:3\.1[2-9](?:[.\d]*)(?:-slim)?(?:-bookworm|-trixie)?|python:3(?:-slim)?|python:latest|python:slim",
            "trixie", differences="Python 3.13 (Debian trixie) stands in for another Python 3 version"),
    StandIn(r"python:3\.(?:[7-9]|10)(?:[.\d]*)(?:-slim)?-bullseye", "bullseye",
            differences="Debian bullseye's Python 3.9 (/usr/bin, Debian pip) on the same Debian 11 userland, "
                        "instead of python.org's (another 3.x version where the tag names one)"),
    # The Python version decides which pinned wheels exist (numpy 1.21 has none for 3.11), so an
    # older Python takes the nearest Debian one at or above it, even on an older userland.
    StandIn(r"python:3\.[7-9](?:[.\d]*)(?:-slim)?(?:-bookworm)?", "bullseye",
            differences="Debian bullseye's Python 3.9 (/usr/bin, Debian pip) stands in for Python 3.7-3.9, on a "
                        "Debian 11 userland (the official image is Debian 12 bookworm where the tag says so)"),
    StandIn(r"python:3\.10(?:[.\d]*)(?:-slim)?(?:-bookworm)?", "bookworm",
            differences="Python 3.11 (Debian bookworm) stands in for Python 3.10"),
    StandIn(r"debian:(?:bullseye|11)(?:[.\d]*)(?:-slim)?", "bullseye", differences=_DEB.format("bullseye")),
    StandIn(r"debian:(?:bookworm|12)(?:[.\d]*)(?:-slim)?", "bookworm", differences=_DEB.format("bookworm")),
    StandIn(r"debian:(?:trixie|13|stable|latest)(?:[.\d]*)(?:-slim)?|debian", "trixie",
            differences=_DEB.format("trixie")),
    StandIn(r"ubuntu:(?:24\.04|noble|latest)|ubuntu", "trixie", users=UBUNTU_USERS,
            differences="Debian trixie stands in for Ubuntu 24.04 (glibc 2.41 vs 2.39, Python 3.13 vs 3.12, OpenSSL "
                        "3.5 vs 3.0, Debian archive instead of Ubuntu's; apt-get works the same; python3 and pip "
                        "preinstalled, which the official image lacks)"),
    StandIn(r"ubuntu:(?:22\.04|jammy|20\.04|focal)", "bookworm",
            differences="Debian bookworm stands in for Ubuntu 22.04/20.04 (Debian archive instead of Ubuntu's)"),
    StandIn(r"ghcr\.io/laude-institute/t-bench/python-3-13:.*", "bookworm", python="3.13",
            packages=("tmux", "asciinema"), workdir="/app",
            differences=_PYORG.format("3.13", "Debian 12 bookworm") + _TB1),
    # trixie's asciinema pulls python3-pkg-resources, which leaves setuptools/_vendor/ without
    # setuptools: Python then imports `setuptools` as an empty namespace package and setup.py
    # builds fail ("no attribute 'setup'"). Ubuntu 24.04 has no such folder, and its python3-pip
    # brings setuptools; the stand-in installs python3-setuptools so the folder is whole.
    # fonts-dejavu-core: tasks draw text with whatever font the image has; chess-best-move's board
    # (Unicode chess glyphs, drawn at build time) is legible only with one that has them, so the
    # official image must have such a font (its oracle resolves with DejaVu, and only then).
    StandIn(r"ghcr\.io/laude-institute/t-bench/ubuntu-24-04:.*", "trixie",
            packages=("tmux", "asciinema", "python3-setuptools", "fonts-dejavu-core"), workdir="/app", users=UBUNTU_USERS,
            differences="Debian trixie stands in for Ubuntu 24.04 (see ubuntu:24.04)" + _TB1
            + "; python3-setuptools preinstalled (trixie's asciinema leaves a partial setuptools folder); "
              "fonts-dejavu-core (inferred: chess-best-move's board must be legible)"),
)
"""Registry images and the stand-in that replaces each, first match wins."""

DEFAULT_BOOTSTRAP_TAGS = (
    "python:3.13-slim-bookworm", "python:3.13-slim", "python:3.12-slim-bookworm", "python:3.11-slim-bookworm",
    "python:3.11-slim", "debian:bookworm", "debian:bookworm-slim", "debian:trixie", "ubuntu:24.04", "ubuntu:22.04",
    "ghcr.io/laude-institute/t-bench/python-3-13:20250620", "ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest",
)
"""Names ``t1async images bootstrap`` tags by default (others are tagged on first use)."""

HUB_HOSTS = ("docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com", "mirror.gcr.io")
"""Registries that serve Docker Hub itself (``library/`` is its official-images namespace)."""

LIBRARY_MIRRORS = ("public.ecr.aws/docker/library/",)
"""Prefixes under which other registries mirror Docker's official library."""


# --------------------------------------------------------------------------------- names


def normalise(ref: str) -> str:
    """The Docker Hub short form of ``ref``: ``repo:tag``.

    A digest (``@sha256:...``) is dropped, ``:latest`` added when there is no tag, and Docker
    Hub's hosts (``docker.io``, ``index.docker.io``, ``registry-1.docker.io``,
    ``registry.hub.docker.com``, its mirror ``mirror.gcr.io``) and the official library's
    mirrors (``public.ecr.aws/docker/library/``) are removed along with ``library/``:
    ``public.ecr.aws/docker/library/debian:bookworm-slim@sha256:ab...`` -> ``debian:bookworm-slim``,
    ``docker.io/someone/tool`` -> ``someone/tool:latest``. Other registries' names keep their
    host (``ghcr.io/owner/image:tag``). Pure string work; never raises.
    """
    ref = ref.strip()
    if "@" in ref:
        ref = ref.split("@", 1)[0]
    host, slash, rest = ref.partition("/")
    if slash and host.lower() in HUB_HOSTS:
        ref = rest
    for prefix in LIBRARY_MIRRORS:
        if ref.lower().startswith(prefix):
            ref = ref[len(prefix):]
            break
    if ref.startswith("library/"):
        ref = ref[len("library/"):]
    last = ref.rsplit("/", 1)[-1]
    return ref if ":" in last else ref + ":latest"


def qualified(ref: str) -> str:
    """The fully qualified local name ``ref`` stands for (``python:3.13`` ->
    ``docker.io/library/python:3.13``; a mirror's name of an official image -> the
    ``docker.io/library/`` one; no digest), which stand-ins are tagged as and ``FROM`` lines are
    pointed at. Never raises."""
    ref = normalise(ref)
    first = ref.split("/", 1)[0]
    if "/" not in ref:
        return f"docker.io/library/{ref}"
    if "." in first or ":" in first or first == "localhost":
        return ref
    return f"docker.io/{ref}"


def stand_in_for(ref: str) -> StandIn | None:
    """The stand-in rule for the image ``ref`` (any spelling :func:`normalise` accepts), or None."""
    name = normalise(ref)
    for rule in STAND_INS:
        if re.fullmatch(rule.pattern, name) or re.fullmatch(rule.pattern, name.removesuffix(":latest")):
            return rule
    return None


# --------------------------------------------------------------------------------- the chain


def chain(rule: StandIn) -> list[tuple[str, str]]:
    """The images ``rule``'s stand-in is built from, in build order: ``[(kind, tag), ...]`` with
    kind ``rootfs``, ``python`` or ``config``; the last tag is the stand-in itself."""
    name = rule.suite + ("-nopython" if rule.python else "")
    steps = [("rootfs", f"{BASE_REPO}/{name}:{ROOTFS_VERSION}")]
    if rule.python:
        name = f"{rule.suite}-python{rule.python}"
        steps.append(("python", f"{BASE_REPO}/{name}:{ROOTFS_VERSION}"))
    if rule.packages or rule.workdir or rule.users:
        name += "-" + "-".join((*rule.packages, *(f"user-{user}" for user, _ in rule.users),
                                *(["workdir" + rule.workdir.replace("/", "-")] if rule.workdir else [])))
        steps.append(("config", f"{BASE_REPO}/{name}:{ROOTFS_VERSION}"))
    return steps


def rootfs_tag(rule: StandIn) -> str:
    """Local tag of the finished stand-in image for ``rule`` (the last of :func:`chain`)."""
    return chain(rule)[-1][1]


def python_layer_dockerfile(parent: str, version: str, source_suite: str = PYTHON_SOURCE_SUITE) -> str:
    """Dockerfile text of the CPython layer: ``FROM parent``, CPython ``version`` (``3.13``) from
    Debian ``source_suite``'s ``python<version>`` source package, configured like python.org's
    images (``--enable-shared``, loadable sqlite extensions, ensurepip; no PGO/LTO), installed
    into ``/usr/local`` with the ``python3``/``python``/``pip``/``pip3`` links; build tools purged."""
    deps = " ".join(PYTHON_BUILD_DEPS)
    script = f"""set -eu
echo 'deb-src {DEBIAN_MIRROR} {source_suite} main' > /etc/apt/sources.list.d/t1async-python-source.list
apt-get update -qq
kept="$(apt-mark showmanual)"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends {deps} >/dev/null
mkdir -p /usr/src/python && cd /usr/src/python
apt-get source --download-only -qq python{version}
tar -xf python{version}_*.orig.tar.xz && cd Python-{version}.*/
./configure --build="$(dpkg-architecture --query DEB_BUILD_GNU_TYPE)" --enable-loadable-sqlite-extensions \\
    --enable-option-checking=fatal --enable-shared --with-ensurepip=install > /tmp/configure.log 2>&1 \\
    || {{ tail -40 /tmp/configure.log; exit 1; }}
make -j"$(nproc)" > /tmp/make.log 2>&1 || {{ grep -m5 -i error /tmp/make.log; tail -20 /tmp/make.log; exit 1; }}
grep -A4 -e 'necessary bits to build' -e 'Failed to build these' /tmp/make.log || true
make install > /tmp/install.log 2>&1 || {{ tail -20 /tmp/install.log; exit 1; }}
cd / && rm -rf /usr/src/python /tmp/*.log /etc/apt/sources.list.d/t1async-python-source.list
find /usr/local -depth \\( \\( -type d -a \\( -name test -o -name tests -o -name idle_test \\) \\) \\
    -o \\( -type f -a \\( -name '*.pyc' -o -name '*.pyo' -o -name 'libpython*.a' \\) \\) \\) -exec rm -rf '{{}}' +
ldconfig
apt-mark auto '.*' > /dev/null
[ -z "$kept" ] || apt-mark manual $kept > /dev/null
find /usr/local -type f -executable -exec ldd '{{}}' ';' 2>/dev/null \\
    | awk '/=>/ {{ so = $(NF-1); if (index(so, "/usr/local/") == 1) next; gsub("^/(usr/)?", "", so); print "*" so }}' \\
    | sort -u | xargs -r dpkg-query --search 2>/dev/null | cut -d: -f1 | sort -u | xargs -r apt-mark manual > /dev/null
DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq {deps} > /dev/null
DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq --auto-remove -o APT::AutoRemove::RecommendsImportant=false \
    -o APT::AutoRemove::SuggestsImportant=false > /dev/null
apt-get clean && rm -rf /var/lib/apt/lists/*
cd /usr/local/bin
for name in idle3 pydoc3 python3 python3-config pip3; do [ -e "$name" ] && [ ! -e "${{name%3}}" ] && ln -s "$name" "${{name%3}}"; done
python3 --version && pip --version && python3 -m venv /tmp/venv-check && rm -rf /tmp/venv-check
python3 -c 'import bz2, ctypes, curses, dbm.gnu, decimal, lzma, readline, sqlite3, ssl, uuid, zlib'
"""
    return "\n".join([
        f"FROM {parent}",
        "ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8",
        f"RUN {_json_sh(script)}",
        'CMD ["python3"]',
    ]) + "\n"


def config_layer_dockerfile(parent: str, rule: StandIn) -> str:
    """Dockerfile text of the config layer: ``FROM parent``, ``rule.packages`` installed with apt
    (recommends included, as ``apt-get install -y`` does), ``rule.users`` created, ``WORKDIR
    rule.workdir`` (created)."""
    lines = [f"FROM {parent}"]
    if rule.packages:
        lines.append("RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                     f"{' '.join(rule.packages)} > /dev/null && rm -rf /var/lib/apt/lists/*")
    for user, uid in rule.users:
        lines.append(f"RUN groupadd -g {uid} {user} && useradd -m -u {uid} -g {uid} -s /bin/bash {user}")
    if rule.workdir:
        lines += [f"RUN mkdir -p {shlex.quote(rule.workdir)}", f"WORKDIR {rule.workdir}"]
    lines.append('CMD ["bash"]')
    return "\n".join(lines) + "\n"


def _json_sh(script: str) -> str:
    return json.dumps(["/bin/sh", "-c", script])


def apt_sources(suite: str, mirror: str = DEBIAN_MIRROR) -> list[str]:
    """The apt sources a root filesystem of ``suite`` is built from and keeps, as mmdebstrap
    arguments: with the default mirror, the release, its ``-updates`` and its security archive
    (``deb.debian.org/debian-security``), as the official Debian images have; another mirror is
    used alone (``[mirror]``)."""
    if mirror != DEBIAN_MIRROR:
        return [mirror]
    return [f"deb {mirror} {suite} main", f"deb {mirror} {suite}-updates main",
            f"deb {mirror}-security {suite}-security main"]


def build_rootfs(engine: Engine, rule: StandIn, *, mirror: str = DEBIAN_MIRROR, log: Path | None = None) -> float:
    """mmdebstrap the root filesystem of ``rule`` (the first of :func:`chain`) and import it; seconds taken.

    Raises:
        SandboxUnavailable: mmdebstrap is not installed.
        BuildError: mmdebstrap or the import failed (the message has the tail of its output).
    """
    if shutil.which("mmdebstrap") is None:
        raise SandboxUnavailable("mmdebstrap not found: `apt-get install mmdebstrap` (tools/setup.sh does it)")
    started = time.monotonic()
    packages = ",".join(BASE_PACKAGES + (() if rule.python else DEBIAN_PYTHON_PACKAGES))
    hooks = [
        'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',  # pip may install system-wide, as in python images
        'if [ -e "$1"/usr/bin/python3 ]; then mkdir -p "$1"/usr/local/bin && cd "$1"/usr/local/bin && '
        'ln -sf /usr/bin/python3 python3 && ln -sf /usr/bin/python3 python && ln -sf /usr/bin/pip3 pip && '
        'ln -sf /usr/bin/pip3 pip3; fi',
        'for n in 1 2 3 4 5 6 7 8; do mkdir -p "$1"/usr/share/man/man$n; done',  # update-alternatives needs them
        f'printf %s {shlex.quote(APT_CLEAN_CONF)} > "$1"/etc/apt/apt.conf.d/docker-clean',
        'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin',
        f'{shlex.quote(sys.executable)} -c {shlex.quote(PIP_RECORDS_SCRIPT)} "$1"',  # pip may upgrade them
    ]
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tag = chain(rule)[0][1]
    with tempfile.TemporaryDirectory(prefix="t1async-rootfs-", dir=CACHE_DIR) as tmp:
        tar = Path(tmp) / "rootfs.tar"
        argv = ["mmdebstrap", "--variant=minbase", f"--include={packages}",
                "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
                *[f"--customize-hook={hook}" for hook in hooks], rule.suite, str(tar), *apt_sources(rule.suite, mirror)]
        done = subprocess.run(argv, capture_output=True, timeout=1800)
        text = (done.stdout + done.stderr).decode("utf-8", "replace")
        if log is not None:
            with open(log, "a") as handle:
                handle.write(f"$ {' '.join(argv)}\n{text}\n")
        if done.returncode != 0:
            errors = [line for line in text.splitlines() if line.startswith(("E:", "error", "Error"))]
            raise BuildError(f"mmdebstrap {rule.suite} failed (exit {done.returncode}): "
                             f"{(errors or text.strip().splitlines() or [''])[0][:400]}")
        changes = ["ENV LANG=C.UTF-8", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   'CMD ["bash"]']
        engine.run("import", *[opt for change in changes for opt in ("--change", change)], str(tar), tag,
                   timeout_s=600)
    return time.monotonic() - started


def build_stand_in(engine: Engine, rule: StandIn, *, mirror: str = DEBIAN_MIRROR, rebuild: bool = False,
                   log: Path | None = None) -> dict[str, float]:
    """Build the images of ``rule``'s :func:`chain` that are missing (all with ``rebuild``), each
    once across processes (a lock per tag); returns ``{tag: seconds}`` of those built.

    Raises:
        SandboxUnavailable: mmdebstrap is not installed.
        BuildError: a step failed (see :func:`build_rootfs` and :func:`~t1async.envs.images.engine._build`).
    """
    built: dict[str, float] = {}
    parent = ""
    for kind, tag in chain(rule):
        if rebuild or not engine.image_exists(tag):
            with _build_lock(tag):
                if tag not in built and (rebuild or not engine.image_exists(tag)):
                    started = time.monotonic()
                    if kind == "rootfs":
                        build_rootfs(engine, rule, mirror=mirror, log=log)
                    elif kind == "python":
                        _build(engine, tag, python_layer_dockerfile(parent, rule.python), None, {}, log,
                               timeout_s=max(engine.cfg.build_timeout_s, PYTHON_BUILD_TIMEOUT_S))
                    else:
                        _build(engine, tag, config_layer_dockerfile(parent, rule), None, {}, log)
                    built[tag] = round(time.monotonic() - started, 1)
        parent = tag
    return built


def describe(engine: Engine, tag: str) -> str:
    """What backs the image ``tag``, read from a container of it: ``"Debian 12.12 (bookworm),
    Python 3.13.5 at /usr/local/bin/python3.13"`` (the interpreter ``python3`` resolves to); "" when
    it cannot be run. Takes about a second."""
    script = ('. /etc/os-release; v=$(cat /etc/debian_version 2>/dev/null); p=$(readlink -f "$(command -v python3)"); '
              'echo "${NAME%% *} ${v:-$VERSION_ID} (${VERSION_CODENAME:-?}), $($p --version 2>&1) at $p"')
    done = engine.run("run", "--rm", "--network", "none", *engine.ulimits(), "--entrypoint", "/bin/sh", tag, "-c",
                      script, check=False, timeout_s=120)
    return done.stdout.decode("utf-8", "replace").strip() if done.returncode == 0 else ""


# --------------------------------------------------------------------------------- resolving and bootstrapping


def resolve_base(engine: Engine, ref: str, *, bootstrap_missing: bool = False) -> tuple[str, str]:
    """Make ``ref`` resolvable locally: present (as written or as :func:`qualified`), or
    :func:`qualified` tagged from its stand-in (built first when ``bootstrap_missing``).

    Returns:
        ``(local name, image ID)``: the name a ``FROM`` line must use to find it without a
        registry (``ref`` itself when present as written; else the qualified name, which drops a
        digest and a mirror's host) and the ID it resolves to.

    Raises:
        SandboxError: missing, with no stand-in (or its stand-in not bootstrapped); the message
            says to run ``t1async images bootstrap`` or pull it.
    """
    found = engine.image_id(ref)
    if found:
        return ref, found
    local = qualified(ref)
    found = engine.image_id(local)
    if found:
        return local, found
    rule = stand_in_for(ref)
    if rule is None:
        raise SandboxError(f"base image {ref!r} is not in local storage and t1async has no stand-in for it: "
                           f"`{engine.name} pull {ref}` where a registry is reachable")
    tag = rootfs_tag(rule)
    if not engine.image_exists(tag):
        if not bootstrap_missing:
            raise SandboxError(f"base image {ref!r} is not in local storage: run `t1async images bootstrap` (builds a "
                               f"Debian {rule.suite} stand-in offline) or `{engine.name} pull {ref}`")
        build_stand_in(engine, rule)
    engine.run("tag", tag, local, timeout_s=60)
    logger.info("{} stands in for {}: {}", tag, ref, rule.differences)
    return local, engine.image_id(tag)


def ensure_base_id(engine: Engine, ref: str, *, bootstrap_missing: bool = False) -> str:
    """The image ID ``ref`` resolves to after :func:`resolve_base` (same errors)."""
    return resolve_base(engine, ref, bootstrap_missing=bootstrap_missing)[1]


def ensure_base(engine: Engine, ref: str, *, bootstrap_missing: bool = False) -> str:
    """Make ``ref`` resolvable locally (:func:`resolve_base`); returns the local name to use."""
    return resolve_base(engine, ref, bootstrap_missing=bootstrap_missing)[0]


@dataclass
class BootstrapReport:
    """What ``t1async images bootstrap`` did.

    Attributes:
        built: images built, {tag: seconds}.
        tagged: {image name: (stand-in tag, differences from the official image)}.
        present: names already in local storage (left alone: a pulled real image wins).
        unknown: names with no stand-in that are not in local storage either.
        backing: {stand-in tag: what backs it, from :func:`describe`}.
    """

    built: dict[str, float] = field(default_factory=dict)
    tagged: dict[str, tuple[str, str]] = field(default_factory=dict)
    present: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    backing: dict[str, str] = field(default_factory=dict)


def bootstrap(engine: Engine, names: list[str], *, mirror: str = DEBIAN_MIRROR, rebuild: bool = False,
              log: Path | None = None, describe_images: bool = True) -> BootstrapReport:
    """Build the stand-ins ``names`` need and tag each name (see the module docstring). Names with
    no stand-in are listed in :attr:`BootstrapReport.unknown` (or ``present`` when pulled) and
    the others still done.

    Raises:
        SandboxUnavailable: mmdebstrap is not installed.
        SandboxError: a build failed (:class:`~t1async.envs.images.engine.BuildError`).
    """
    report = BootstrapReport()
    rules: dict[str, StandIn] = {}
    for ref in names:
        rule = stand_in_for(ref)
        if rule is not None:
            rules[ref] = rule
        elif engine.image_exists(ref) or engine.image_exists(qualified(ref)):
            report.present.append(ref)
        else:
            report.unknown.append(ref)
    for rule in dict.fromkeys(rules.values()):
        report.built.update(build_stand_in(engine, rule, mirror=mirror, rebuild=rebuild, log=log))
    for ref, rule in rules.items():
        target = qualified(ref)
        if not rebuild and engine.image_exists(target) and not _is_stand_in(engine, target):
            report.present.append(ref)
            continue
        engine.run("tag", rootfs_tag(rule), target, timeout_s=60)
        report.tagged[ref] = (rootfs_tag(rule), rule.differences)
    if describe_images:
        for tag, _ in dict.fromkeys(report.tagged.values()):
            report.backing.setdefault(tag, describe(engine, tag))
    return report


def _is_stand_in(engine: Engine, ref: str) -> bool:
    """Whether ``ref`` is a tag of a stand-in image (this version's or an older one's, which a
    new bootstrap replaces), rather than a pulled image, which it leaves alone."""
    image_id = engine.image_id(ref)
    listed = engine.run("images", "--no-trunc", "--format", "{{.ID}} {{.Repository}}", check=False, timeout_s=60)
    ours = {line.split()[0].removeprefix("sha256:") for line in listed.stdout.decode().splitlines()
            if len(line.split()) == 2 and line.split()[1].startswith(BASE_REPO + "/")}
    return bool(image_id) and image_id in ours
