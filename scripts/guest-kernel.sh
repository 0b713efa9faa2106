#!/usr/bin/env bash
# Run CMD as root inside a qemu guest whose kernel has netem (for hosts whose kernel has not):
#   bash scripts/guest-kernel.sh [--kernel VMLINUZ] [--mem 2G] [--cpus 2] [--accel auto|kvm|tcg]
#                                [--out DIR]... [--timeout S] [--verbose] -- CMD...
# The guest sees the host's filesystem (read-only root with a throwaway overlay; this project and each
# --out directory writable), loads netem, HTB, TBF, IFB, veth, bridge and NFQUEUE, and exits with CMD's
# status. Details: testbed/net/guest.py and docs/network.md ("Testing the netem path without netem").
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# The system interpreter and the standard library only: this works before and without the virtualenv.
exec env PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" /usr/bin/python3 -m testbed.net.guest "$@"
