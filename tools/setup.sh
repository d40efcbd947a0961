#!/usr/bin/env bash
# Set up t1async on a fresh clone: Debian packages (bubblewrap for the sandbox), a virtual
# environment in .venv with a CPU build of torch, and the package with its test, megatron, endpoint and plot extras
# (megatron-core: the tests compare the Megatron learner backend with the torch one).
# Idempotent: re-running installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# command -> Debian package: the sandbox (bwrap) and the host tools the shipped tasks' setups,
# tests and oracle solutions use.
missing=()
for pair in bwrap:bubblewrap setpriv:util-linux nsenter:util-linux git:git sqlite3:sqlite3 zip:zip unzip:unzip pgrep:procps tar:tar gzip:gzip; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The container sandbox (env.sandbox: container): podman with runc (crun fails on hosts with
# cgroups in hybrid mode) and mmdebstrap for `t1async images bootstrap`. Optional: a host where
# they cannot be installed keeps the local sandbox, and the container tests skip.
optional=()
for pair in podman:podman runc:runc mmdebstrap:mmdebstrap; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || optional+=("${pair#*:}")
done
if [ ${#optional[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing Debian packages for the container sandbox: ${optional[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${optional[@]}" >/dev/null; } \
    || echo "setup: could not install ${optional[*]}: the container sandbox stays unavailable (local works)"
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,megatron,endpoint,plot]'
# optional: the agent harnesses the slow tests drive (Codex CLI speaks Responses, Claude Code Messages);
# without npm or a registry they are left out and those tests skip, naming the install command
if command -v npm >/dev/null 2>&1; then
  NPM_SUDO=""; [ "$(id -u)" = 0 ] || NPM_SUDO="sudo"
  for pkg in "codex:@openai/codex@0.169.0" "claude:@anthropic-ai/claude-code@2.1"; do
    command -v "${pkg%%:*}" >/dev/null 2>&1 && continue
    echo "setup: installing ${pkg#*:} (optional)"
    $NPM_SUDO npm install -g -q "${pkg#*:}" >/dev/null 2>&1 || echo "setup: could not install ${pkg#*:}: its tests skip"
  done
else
  echo "setup: npm not found: the codex and claude harness tests skip"
fi
# optional: mini-swe-agent (PyPI) in a venv of its own under /usr/local/lib (every local sandbox sees /usr),
# made from .venv's Python (the sandbox binds that Python); litellm and the rest stay out of .venv
MSWEA=/usr/local/lib/t1async-harness/mini-swe-agent
if [ ! -x "$MSWEA/bin/mini" ]; then
  echo "setup: installing mini-swe-agent 2.4.6 into $MSWEA (optional)"
  PIP_SUDO=""; [ "$(id -u)" = 0 ] || PIP_SUDO="sudo"
  { $PIP_SUDO "$PWD/.venv/bin/python" -m venv "$MSWEA" \
      && $PIP_SUDO "$MSWEA/bin/pip" install -q --disable-pip-version-check mini-swe-agent==2.4.6 >/dev/null 2>&1; } \
    || echo "setup: could not install mini-swe-agent: its tests skip"
fi
echo "setup: done (.venv/bin/t1async)"
