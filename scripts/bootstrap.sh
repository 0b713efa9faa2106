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

# g++ and python3-dev: torch.compile's inductor CPU backend builds C++ (benchmarks/compile_probe.py)
APT_PKGS="mininet iproute2 iptables iperf3 ethtool tcpdump iputils-ping procps psmisc python3 python3-venv python3-dev g++"
export DEBIAN_FRONTEND=noninteractive
apt_updated=""
apt_install() {  # apt_install PKG...: only what is not installed yet
  local missing="" p
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  [ -z "$missing" ] && return 0
  log "installing Debian packages:$missing"
  [ -n "$apt_updated" ] || { apt-get update -qq; apt_updated=1; }
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
}
apt_install $APT_PKGS

# Where this kernel has no netem: what scripts/guest-kernel.sh needs to run the netem path in a qemu
# guest (docs/network.md, "Testing the netem path on a kernel without it"). Never fatal: without a
# guest the testbed uses the delay line and the netem tests skip saying why.
guest_kernel_ok() { ls /lib/modules/*/kernel/net/sched/sch_netem.ko* >/dev/null 2>&1 && ls /boot/vmlinuz-* >/dev/null 2>&1; }
if ! unshare --net tc qdisc add dev lo root netem delay 1ms 2>/dev/null && [ "$(dpkg --print-architecture)" = amd64 ]; then
  apt_install qemu-system-x86 busybox-static || log "warning: qemu/busybox-static not installed: no guest kernel for the netem tests"
  if ! guest_kernel_ok; then
    . /etc/os-release
    kpkg=linux-image-amd64; [ "${ID:-}" = ubuntu ] && kpkg=linux-image-generic
    # The kernel package needs an initramfs tool; tiny-initramfs satisfies that without pulling in
    # systemd/udev (initramfs-tools does), and INITRD=No skips initramfs-tools' hook where it exists.
    # The guest boots with its own initramfs, so a hook that fails in a container does not matter:
    # what counts is that the kernel image and its modules are on disk.
    tool=""; dpkg -s initramfs-tools >/dev/null 2>&1 || dpkg -s dracut >/dev/null 2>&1 || tool=tiny-initramfs
    INITRD=No apt_install "$kpkg" $tool || true
    if guest_kernel_ok; then log "guest kernel for the netem tests: $(ls /boot/vmlinuz-* | tail -1)"
    else log "warning: no kernel with sch_netem for the guest: the netem tests will skip"; fi
  fi
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
if [ "$what" = test ] && ! "$VENV/bin/python" -c 'import ray' 2>/dev/null; then
  # the scale-out tests run a real Ray cluster: the optional `ray` extra is part of the test setup
  log "installing the optional ray extra for the tests"
  "$VENV/bin/pip" install -q -e ".[test,ray]" >"$VENV/pip-install-ray.log" 2>&1 || { cat "$VENV/pip-install-ray.log" >&2; echo "bootstrap: pip install of the ray extra failed" >&2; exit 1; }
fi
"$VENV/bin/python" -c 'import mininet.net, pyroute2, torch' || { echo "bootstrap: the virtualenv cannot import mininet, pyroute2 or torch" >&2; exit 1; }

export PATH="$VENV/bin:$PATH"
case "$what" in
  setup) log "ready: $VENV/bin/prfaas doctor" ; "$VENV/bin/prfaas" doctor ;;
  run)   exec "$VENV/bin/prfaas" quickstart "$@" ;;
  test)  exec "$VENV/bin/python" -m pytest "$@" ;;
  *) echo "bootstrap: unknown action '$what' (allowed: run, test, setup)" >&2; exit 2 ;;
esac
