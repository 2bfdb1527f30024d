#!/usr/bin/env bash
# The headline experiment in one command (root, from anywhere):
#   sudo experiments/run_headline.sh
# 1. pdserve-loadgen runs experiments/headline.yaml: per policy, one emulated 2P2D cluster
#    (experiments/headline-topology.yaml) and one load run; results in
#    results/headline, server logs in results/headline-servers (not committed).
# 2. experiments/analyze.py writes headline.csv, placements.csv and plots/headline.png.
# 3. Whatever happens, the emulation's namespaces (pds-hl-*) are removed and checked.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
cleanup() {
  for ns in $(ip netns list | awk '/^pds-hl-/ {print $1}'); do  # workers a killed launcher left
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] || kill $pids 2>/dev/null || true
  done
  "$PY" -m pdserve.launcher.emulation down --run hl >/dev/null 2>&1 || true
  left=$(ip netns list | grep -c '^pds-hl-' || true)
  [ "$left" = 0 ] || echo "warning: $left pds-hl-* namespaces left" >&2
}
trap cleanup EXIT
rm -rf results/headline results/headline-servers
.venv/bin/pdserve-loadgen experiment experiments/headline.yaml
"$PY" -m experiments.analyze results/headline results/headline-servers
