#!/usr/bin/env bash
# One configuration of the two-GPU study (experiments/two-gpu/spec.yaml), in the foreground:
#   serve.sh CONFIG PORT     CONFIG: pd | colocated | hybrid-loose | hybrid-tight | single
# pd: 1 prefill + 1 decode worker (one GPU each), colocated: 2 mixed workers (least-loaded),
# hybrid-*: 2 mixed workers that also move KV, network-aware with the loose or tight SLO;
# single: 1 mixed worker on one GPU (one-gpu.yaml: one GPU of colocated at half the rate).
# Environment: PYTHON (default python3), TWO_GPU_MODEL (random:llama-3.1-8b), TWO_GPU_PROFILE
# (the profile run_two_gpu.sh measures), TWO_GPU_ARGS (extra `pdserve up` flags, e.g. --device cpu).
set -euo pipefail
config=${1:?usage: serve.sh CONFIG PORT}
port=${2:?usage: serve.sh CONFIG PORT}
py=${PYTHON:-python3}
model=${TWO_GPU_MODEL:-random:llama-3.1-8b}
profile=${TWO_GPU_PROFILE:-experiments/two-gpu/profile.json}
# shellcheck disable=SC2206
extra=(${TWO_GPU_ARGS:-})
up=("$py" -m pdserve.launcher.cli --log-level WARNING up --model "$model" --port "$port" "${extra[@]}")
case "$config" in
  pd)           exec "${up[@]}" --prefill 1 --decode 1 --policy round-robin ;;
  colocated)    exec "${up[@]}" --mode colocated --replicas 2 --policy least-loaded ;;
  hybrid-loose) exec "${up[@]}" --mode hybrid --replicas 2 --policy network-aware --profile "$profile" \
                  --slo-ttft 1 --slo-tpot 0.05 ;;
  hybrid-tight) exec "${up[@]}" --mode hybrid --replicas 2 --policy network-aware --profile "$profile" \
                  --slo-ttft 1 --slo-tpot 0.01 ;;
  single)       exec "${up[@]}" --mode colocated --replicas 1 --policy least-loaded ;;
  *) echo "serve.sh: unknown CONFIG '$config' (pd, colocated, hybrid-loose, hybrid-tight, single)" >&2; exit 2 ;;
esac
