#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine: Python venv at .venv with the project installed.
#   scripts/setup.sh          runtime only (enough for `tars up --preset quickstart`)
#   scripts/setup.sh --dev    + test tools and the Debian packages the GUI backends and their tests need
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
[[ "${1:-}" == "--dev" ]] && DEV=1
PY=${PYTHON:-python3}

need_apt=()      # required: set-up fails without them
want_apt=()      # optional: the tests that need them skip with a reason when they are missing
if [[ $DEV == 1 ]]; then
  for pair in chromium:chromium chromedriver:chromium-driver socat:socat bwrap:bubblewrap Xvfb:xvfb xdotool:xdotool xterm:xterm xclock:x11-apps xwininfo:x11-utils; do
    cmd=${pair%%:*}; pkg=${pair##*:}
    command -v "$cmd" >/dev/null 2>&1 || need_apt+=("$pkg")
  done
  for pair in systemd-analyze:systemd kubectl:kubernetes-client; do
    cmd=${pair%%:*}; pkg=${pair##*:}
    command -v "$cmd" >/dev/null 2>&1 || want_apt+=("$pkg")
  done
fi
if ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then need_apt+=(python3-venv); fi
if (( ${#need_apt[@]} + ${#want_apt[@]} )); then
  if [[ $(id -u) != 0 ]]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq >/dev/null
  if (( ${#need_apt[@]} )); then
    echo "[setup] apt-get install ${need_apt[*]}"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  fi
  for pkg in "${want_apt[@]}"; do
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null 2>&1 \
      && echo "[setup] installed $pkg" || echo "[setup] optional package $pkg not available; its tests will skip"
  done
fi

if [[ ! -x .venv/bin/python ]]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.tars-installed
want="$(cat pyproject.toml | sha256sum | cut -c1-16)-dev$DEV"
if [[ ! -f $stamp || "$(cat $stamp)" != "$want" ]]; then
  echo "[setup] installing Python packages"
  .venv/bin/pip install -q --disable-pip-version-check 'torch==2.13.0'
  if [[ $DEV == 1 ]]; then
    .venv/bin/pip install -q --disable-pip-version-check -e '.[dev]'
  else
    .venv/bin/pip install -q --disable-pip-version-check -e .
  fi
  echo "$want" > $stamp
fi
echo "[setup] ready: .venv/bin/tars"
