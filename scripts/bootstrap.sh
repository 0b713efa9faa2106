#!/usr/bin/env bash
# One entry point for a fresh Debian/Ubuntu host, run as root:
#   bash scripts/bootstrap.sh run    set everything up, then run the default scenario
#   bash scripts/bootstrap.sh test   set everything up, then run the test suite
#   bash scripts/bootstrap.sh setup  set everything up only
# Idempotent: a second call only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${PRFAAS_VENV:-$ROOT/.venv}
what=${1:-run}; shift || true

log() { printf '\033[1m[bootstrap]\033[0m %s\n' "$*"; }

if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then how="sudo bash scripts/bootstrap.sh $what"; else how="su -c 'bash scripts/bootstrap.sh $what'"; fi
  echo "bootstrap: run as root ($how): the testbed creates network namespaces and qdiscs" >&2
  exit 2
fi

APT_PKGS="mininet iproute2 iptables iperf3 ethtool tcpdump iputils-ping procps psmisc python3 python3-venv python3-dev"
missing=""
for p in $APT_PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  log "installing Debian packages:$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# The system interpreter: Debian's mininet package (which ships mnexec) installs its module there.
PY=/usr/bin/python3
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
# Make Debian's mininet module importable from the venv without pulling in all of dist-packages.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
MN_SRC=$("$PY" -c 'import mininet, os; print(os.path.dirname(mininet.__file__))')
[ -e "$SITE/mininet" ] || ln -s "$MN_SRC" "$SITE/mininet"

stamp="$VENV/.prfaas-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log "installing Python dependencies into $VENV (torch 2.13.0, CPU build unless a local CUDA wheel is configured)"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  pip_log="$VENV/pip-install.log"
  if ! "$VENV/bin/pip" install -q -e ".[test]" >"$pip_log" 2>&1; then
    cat "$pip_log" >&2; echo "bootstrap: pip install failed (log above, also in $pip_log)" >&2; exit 1
  fi
  touch "$stamp"
fi
"$VENV/bin/python" -c 'import mininet.net, pyroute2, torch' || { echo "bootstrap: the virtualenv cannot import mininet, pyroute2 or torch" >&2; exit 1; }

export PATH="$VENV/bin:$PATH"
case "$what" in
  setup) log "ready: $VENV/bin/prfaas doctor" ; "$VENV/bin/prfaas" doctor ;;
  run)   exec "$VENV/bin/prfaas" quickstart "$@" ;;
  test)  exec "$VENV/bin/python" -m pytest "$@" ;;
  *) echo "bootstrap: unknown action '$what' (allowed: run, test, setup)" >&2; exit 2 ;;
esac
