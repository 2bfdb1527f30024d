#!/usr/bin/env bash
# The two-GPU study (docs/two-gpu.md), in steps that each fit one device call:
#   run.sh kv        KV GPU0 -> GPU1 against raw ucxx and NCCL   -> kvtransfer.txt
#   run.sh profile   `pdserve profile` of the model on one GPU    -> profile.json
#   run.sh profile-mixed  the same plus the mixed-step table (--mixed; ~3 min on one H200)
#                    -> profile-mixed.json (sim_fidelity_two_gpu's chained-mixed model)
#   run.sh CONFIG..  the sweep of those configurations: pd colocated hybrid-loose hybrid-tight
#                    (single: one mixed worker, for one-gpu.yaml on a one-GPU machine)
#   run.sh analyze   tables and plots (needs matplotlib)          -> table.md, plots/
#   run.sh all       kv, profile, the four configurations and analyze, in this order
# Results: results/two-gpu/ (RESULTS to change). Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
results=${RESULTS:-results/two-gpu}
model=${TWO_GPU_MODEL:-random:llama-3.1-8b}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TWO_GPU_PROFILE=${TWO_GPU_PROFILE:-$results/profile.json}
mkdir -p "$results"
steps=("$@")
[ ${#steps[@]} -gt 0 ] || { sed -n '2,12p' "$0"; exit 2; }
[ "${steps[0]}" = all ] && steps=(kv profile pd colocated hybrid-loose hybrid-tight analyze)
for step in "${steps[@]}"; do
  echo "== $step ($(date -u +%H:%M:%S))"
  case "$step" in
    kv) "$py" -m benchmarks.bench_kvtransfer --device cuda --receiver-device cuda:1 --tokens 2048 8192 \
          --repeat 5 2>&1 | tee "$results/kvtransfer.txt" ;;
    profile) "$py" -m pdserve.launcher.cli profile --model "$model" --out "$results/profile.json" -q \
          --prefill-tokens 128,512,1024,2048,4096 --decode-batches 1,8,32,64 --decode-contexts 512,2048 \
          --repeats 2 --decode-steps 8 2>&1 | tee "$results/profile.txt" ;;
    profile-mixed) "$py" -m pdserve.launcher.cli profile --model "$model" --out "$results/profile-mixed.json" -q \
          --prefill-tokens 128,512,1024,2048,4096 --decode-batches 1,8,32,64 --decode-contexts 512,2048 \
          --repeats 2 --decode-steps 8 --mixed --mixed-batches 1,4,16,32,64 --mixed-chunks 64,128,256,512 \
          --mixed-context 2048 2>&1 | tee "$results/profile-mixed.txt" ;;
    pd|colocated|hybrid-loose|hybrid-tight|single)
      "$py" -m pdserve.loadgen.cli experiment "${SPEC:-experiments/two-gpu/spec.yaml}" --policy "$step" \
          --output-dir "$results/$step" --no-progress ;;
    analyze) "$py" -m experiments.two-gpu.analyze --results "$results" ;;
    *) echo "run.sh: unknown step '$step'" >&2; exit 2 ;;
  esac
done
