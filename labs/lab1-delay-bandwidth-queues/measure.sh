#!/usr/bin/env bash
# Lab 1: measure one queue size. Usage (as root): bash measure.sh 0.25bdp runs/q0.25
# Brings the lab's network up with that queue, records the configured figures (prfaas check), pings
# across the idle WAN, then pings again while TCP (iperf3, CUBIC) fills it, and tears it down.
# LAB1_SECONDS (default 12) is how long the flows run; the loaded pings start 3 s into them.
# LAB1_STREAMS (default 1) parallel flows: try 4 and compare (one flow grows its window slowly).
set -euo pipefail
queue=$1; out=$2
secs=${LAB1_SECONDS:-12}; streams=${LAB1_STREAMS:-1}; settle=$(( secs / 4 < 3 ? secs / 4 : 3 )); pings=$(( (secs - settle - 1) * 5 ))
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
prfaas check "$here/wan.yaml" --set wan.queue="$queue" --json > "$out/check.json"
up=$(prfaas net up "$here/wan.yaml" --set wan.queue="$queue" --detach)
echo "$up"
tag=$(awk '/^network [0-9a-f]+ up/ {print $2}' <<< "$up")              # this network's id: other networks may run beside it
trap 'prfaas net down --id "$tag"' EXIT
dst=$(prfaas net exec --id "$tag" pd-x0 -- hostname -I | awk '{print $1}')   # pd-x0's address
prfaas net exec --id "$tag" pd-x0 -- iperf3 -s -D -1                    # a server for one test
prfaas net exec --id "$tag" prfaas-x0 -- ping -n -c 10 -i 0.2 "$dst" > "$out/ping-idle.txt"
prfaas net exec --id "$tag" prfaas-x0 -- iperf3 -c "$dst" -t "$secs" -P "$streams" -J > "$out/iperf3.json" &
sleep "$settle"                                                         # past slow start
prfaas net exec --id "$tag" prfaas-x0 -- ping -n -c "$pings" -i 0.2 "$dst" > "$out/ping-loaded.txt"
wait
echo "wrote $out: check.json iperf3.json ping-idle.txt ping-loaded.txt"
