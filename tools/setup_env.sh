#!/usr/bin/env bash
# Create the project venv and install Gyre with its test tools. torch goes first, pinned to the
# CPU build, so that no later requirement pulls a multi-GB CUDA wheel.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

# libibverbs1: Mooncake Transfer Engine's wheel links it even for TCP (its import fails without it).
# hdf5-tools: h5dump/h5ls, the standard HDF5 tools the shard tests read shards with.
# bubblewrap: bwrap, the default sandbox of every harness and checker (sandbox.backend=bwrap).
# acl: setfacl, with which tests/test_unprivileged.py lets its user search a checkout in a folder of mode 0700.
# buildah, mmdebstrap: task environment images (gyre/tasks/images.py) and the bases tools/make_base_images makes.
# gcc, libc6-dev: build the Harbor reward guard (gyre/tasks/runner_hooks/reward_guard.c) on first use.
# python3-pytest ... python3-simplejson: what the tests of the real SWE-bench instances in examples/tasks/swebench_real
# import when they run without their images (tasks.build_images=false), for the system python3 that bwrap sandboxes see
# (/usr): pytest, Flask 2.3's and marshmallow 3.0's test dependencies. Their images get SWE-bench's pins from PyPI instead.
GYRE_APT_PACKAGES=${GYRE_APT_PACKAGES-libibverbs1 hdf5-tools bubblewrap acl gcc libc6-dev buildah mmdebstrap python3-pytest python3-werkzeug python3-jinja2
  python3-itsdangerous python3-click python3-blinker python3-dotenv python3-tz python3-simplejson}
need_apt=()
if command -v dpkg >/dev/null; then
  for pkg in ${GYRE_APT_PACKAGES}; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
  done
elif [ -n "${GYRE_APT_PACKAGES// /}" ]; then
  echo "gyre setup: not a Debian system (no dpkg): cannot check ${GYRE_APT_PACKAGES}; install their equivalents" \
    "yourself (libibverbs1 is rdma-core's libibverbs, needed to import Mooncake Transfer Engine)" >&2
fi
if ((${#need_apt[@]})); then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "gyre setup: installing Debian packages: ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
  else
    echo "gyre setup: missing Debian packages ${need_apt[*]} and no root apt-get here; install them" \
      "(e.g. sudo apt-get install ${need_apt[*]}; libibverbs1 is needed to import Mooncake Transfer Engine)," \
      "or set GYRE_APT_PACKAGES to the list to check, then re-run" >&2
    exit 1
  fi
fi

# Slurm for the `slurm` test tier: slurm/cluster.sh runs a real multi-node cluster on this machine.
SLURM_APT_PACKAGES="slurmctld slurmd slurm-client munge"
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "gyre setup: installing Slurm: $SLURM_APT_PACKAGES"
    apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $SLURM_APT_PACKAGES
  else
    echo "gyre setup: Slurm is not installed and there is no root apt-get here: the slurm test tier will fail" \
      "until slurmctld, slurmd, the Slurm client tools and munge are installed ($SLURM_APT_PACKAGES on Debian)" >&2
  fi
fi

CACHE=${GYRE_CACHE:-$HOME/.cache/gyre}  # the machine-level cache gyre keeps its images and warm starts in
# the same as gyre/engine/sglang_backend.py SGLANG_VERSION and pyproject's gyre[gpu] (the tests check all three)
SGLANG_VERSION=0.5.23
# install_venv DIR: what the venv holds, each step a no-op when it is installed already
install_venv() {
  local pip=("$1/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install --upgrade pip
  # the CPU build, pinned here (pyproject.toml allows a range: GPU sites get SGLang's torch through gyre[gpu])
  echo "gyre setup: installing torch==2.13.0 (CPU)"
  "${pip[@]}" install "torch==2.13.0"
  echo "gyre setup: installing gyre and its dependencies"
  "${pip[@]}" install -e ".[dev]"
  # SGLang's source, pinned, for the tests that check gyre's requests and command lines against SGLang's own
  # definitions. --no-deps: its requirements pin a CUDA torch and GPU kernels (tests/sglang_io.py explains).
  echo "gyre setup: installing sglang==$SGLANG_VERSION (--no-deps: source only, for payload tests)"
  "${pip[@]}" install --no-deps "sglang==$SGLANG_VERSION"
}
# A new venv starts as a hard-linked copy (a plain copy across filesystems) of one that holds the same packages,
# built once per interpreter, pyproject.toml and this script in the cache (without gyre itself), where pip takes
# 60-90 s to install them again; install_venv then finds them installed and adds gyre from this checkout. The
# copy's scripts name the cached venv's python by absolute path: they are rewritten to name this one (sed -i
# writes new files: the cache's stay as they are; so do pip's, which replaces files rather than editing them).
# Not through from_cache below: that builds in a temporary folder and renames it, which a venv does not survive
# (its scripts would name the temporary folder), so the venv is built in place under an flock instead.
if [ ! -x "$VENV/bin/python" ]; then
  # the interpreter itself (a pyenv or conda shim's name says which one only when it runs), then what is installed
  venv_key=$({ "$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.executable), sys.version)'
    cat pyproject.toml "${BASH_SOURCE[0]}"; } | sha1sum | cut -c1-12)
  cached_venv=$CACHE/venv-$venv_key
  mkdir -p "$CACHE" "$(dirname "$VENV")"
  (
    flock 9  # one setup builds it; the others wait for it, then copy it
    if [ ! -e "$cached_venv/.complete" ]; then
      echo "gyre setup: building $cached_venv with $($PYTHON --version) (the packages every new venv starts from)"
      rm -rf "$cached_venv"
      "$PYTHON" -m venv "$cached_venv"
      install_venv "$cached_venv"
      "$cached_venv/bin/python" -m pip --disable-pip-version-check -q uninstall -y gyre
      touch "$cached_venv/.complete"
    fi
    echo "gyre setup: creating $VENV from $cached_venv"
    rm -rf "$VENV"  # a venv without its python: what an interrupted setup left
    cp -al "$cached_venv" "$VENV" 2>/dev/null || { rm -rf "$VENV" && cp -a "$cached_venv" "$VENV"; }
    rm -f "$VENV/.complete"
  ) 9>"$cached_venv.lock"
  venv_abs=$(cd "$VENV" && pwd)
  { grep -lIr --fixed-strings "$cached_venv" "$VENV/bin" "$VENV/pyvenv.cfg" || true; } |
    xargs -r sed -i "s|$cached_venv|$venv_abs|g"
  for old in "$CACHE"/venv-*.lock; do  # the caches of earlier versions, unless a setup is copying one
    [ "$old" = "$cached_venv.lock" ] && continue
    (flock -n 9 && rm -rf "${old%.lock}" "$old") 9<"$old" || true
  done
fi
install_venv "$VENV"
# from_cache CHECK CACHED DEST BUILD: unless DEST passes CHECK, copy CACHED (under the user's cache) to DEST, first
# building it there when it does not pass CHECK either (BUILD DIR, into a temporary folder renamed when whole; one
# that another setup finished meanwhile is kept, as it may be copying it). What is built this way is relocatable.
from_cache() {
  local ok=$1 cached=$2 dest=$3 build=$4
  "$ok" "$dest" && return 0
  if ! "$ok" "$cached"; then
    echo "gyre setup: building $cached"
    local building=$cached.building.$$
    rm -rf "$building" && mkdir -p "$building"
    "$build" "$building"
    if "$ok" "$cached"; then rm -rf "$building"; else rm -rf "$cached" && mv "$building" "$cached"; fi
  fi
  echo "gyre setup: copying $cached into $dest"
  mkdir -p "$(dirname "$dest")" && rm -rf "$dest"
  cp -a "$cached" "$dest"
  "$ok" "$dest" || { echo "gyre setup: the copied $dest does not run; remove $cached and re-run" >&2; exit 1; }
}
# Claude Code harness: the real CLI from npm, pinned (gyre/harness/claude_code.py CLAUDE_CODE_VERSION), and the
# Codex CLI harness: npm @openai/codex, pinned (gyre/harness/codex.py CODEX_VERSION; ~420 MB: a native binary for
# this platform comes as an optional dependency), both in .gyre/node (gitignored), from the cache (node_modules'
# .bin links are relative). strace lets Claude Code's test check that no traffic leaves loopback.
CLAUDE_CODE_VERSION=$(sed -n 's/^CLAUDE_CODE_VERSION = "\([^"]*\)".*/\1/p' gyre/harness/claude_code.py)
CODEX_VERSION=$(sed -n 's/^CODEX_VERSION = "\([^"]*\)".*/\1/p' gyre/harness/codex.py)
node_ok() {
  [ "$("$1/node_modules/.bin/claude" --version 2>/dev/null | cut -d' ' -f1)" = "$CLAUDE_CODE_VERSION" ] &&
    [ "$("$1/node_modules/.bin/codex" --version 2>/dev/null | cut -d' ' -f2)" = "$CODEX_VERSION" ]
}
node_build() {
  if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
    echo "gyre setup: node and npm are missing: install Node.js >= 18 (e.g. apt-get install nodejs npm)," \
      "then re-run; the Claude Code and Codex harnesses and their tests need" \
      "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION and @openai/codex@$CODEX_VERSION" >&2
    exit 1
  fi
  npm install --prefix "$1" --no-audit --no-fund --save-exact --loglevel=error \
    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION"
}
from_cache node_ok "$CACHE/node-claude-code-$CLAUDE_CODE_VERSION-codex-$CODEX_VERSION" .gyre/node node_build
# mini-swe-agent harness: PyPI mini-swe-agent, pinned (gyre/harness/mini_swe_agent.py MINI_SWE_AGENT_VERSION), in
# its own venv .gyre/mini-swe-agent (litellm's dependency pins are not gyre's), same interpreter as $VENV, from the
# cache (installing it takes a minute or more; gyre runs it as `<venv>/bin/python -m ...`, which a copied venv serves).
MSWEA_VERSION=$(sed -n 's/^MINI_SWE_AGENT_VERSION = "\([^"]*\)".*/\1/p' gyre/harness/mini_swe_agent.py)
BASE_PYTHON=$(readlink -f "$VENV/bin/python")
mswea_ok() { "$1/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('mini-swe-agent') != '$MSWEA_VERSION')" 2>/dev/null; }
mswea_build() {
  "$BASE_PYTHON" -m venv "$1"
  "$1/bin/python" -m pip --disable-pip-version-check -q install "mini-swe-agent==$MSWEA_VERSION"
}
from_cache mswea_ok "$CACHE/mini-swe-agent-$MSWEA_VERSION-$(echo "$BASE_PYTHON" | sha1sum | cut -c1-12)" \
  .gyre/mini-swe-agent mswea_build
if ! command -v strace >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends strace
  else
    echo "gyre setup: strace is missing (the Claude Code test traces its sockets): install it, then re-run" >&2
    exit 1
  fi
fi
echo "gyre setup: done ($VENV)"
