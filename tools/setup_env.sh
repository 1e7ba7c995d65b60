#!/usr/bin/env bash
# Create the project venv and install Gyre with its test tools. torch goes first, pinned to the
# CPU build, so that no later requirement pulls a multi-GB CUDA wheel.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

need_apt=()
for pkg in ${GYRE_APT_PACKAGES:-}; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "gyre setup: installing Debian packages: ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
  else
    echo "gyre setup: missing Debian packages ${need_apt[*]} and no root apt-get here; install them, then re-run" >&2
    exit 1
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "gyre setup: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
echo "gyre setup: installing torch==2.13.0 (CPU)"
"${PIP[@]}" install "torch==2.13.0"
echo "gyre setup: installing gyre and its dependencies"
"${PIP[@]}" install -e ".[dev]"
echo "gyre setup: done ($VENV)"
