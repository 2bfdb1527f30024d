#!/usr/bin/env bash
# The link-rate x policy grid in one command (issue 16), from the repository root:
#
#   experiments/run_gpu_grid.sh            # GPU: experiments/gpu-grid.yaml, random:llama-3.1-8b
#   experiments/run_gpu_grid.sh gpu-smoke  # GPU, ~2 minutes: experiments/gpu-grid-smoke.yaml (2 runs)
#   experiments/run_gpu_grid.sh cpu        # CPU proof of the same path: experiments/gpu-grid-cpu.yaml
#
# 1. The network-aware policy's profile: $PROFILE if given (a `pdserve profile` JSON measured on
#    this hardware), else measured now with a small grid (on GPU 0, before the workers start).
# 1b. links: benchmarks/bench_pacing.py measures every SET rate of the spec (each bandwidth and
#    its --slow-factor share) on a bare link first, two processes on GPU 0 (on the CPU in `cpu`
#    mode), bounded by $LINKS_TIMEOUT_S (default 90 s): cluster/pacing.txt of the results, a
#    pure-link check of each rate that analyze_grid.py quotes next to the in-run figures.
# 2. pdserve.launcher.paced starts 2 prefill + 2 decode workers once (pair i on GPU i mod #GPUs) and
#    samples GPU utilisation; every (policy, bandwidth) of the spec then starts only a router,
#    which sets the pacing of each (P, D) pair first.
# 3. loadgen runs the spec (records, summary.csv, report.md under the spec's output_dir).
# 4. The cluster's files (link rates per configuration, GPU samples, worker tails) are copied
#    next to the results and experiments/analyze_grid.py writes analysis/ (CSV, plots, grid.md).
# The workers are stopped on any exit. Environment: PYTHON (default python3), PROFILE, LINKS_TIMEOUT_S, and
# DEADLINE_S (default 500): seconds from the start after which the sweep is stopped like Ctrl-C
# (the runs done so far are kept and analysed), so that one device call of ~9 minutes always
# brings results back.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-gpu}
PY=${PYTHON:-python3}
case "$MODE" in
  gpu|gpu-smoke)
    NAME=gpu-grid; [ "$MODE" = gpu-smoke ] && NAME=gpu-grid-smoke
    SPEC=experiments/$NAME.yaml; STATE=results/$NAME-state; OUT=results/$NAME
    MODEL=random:llama-3.1-8b
    NGPU=$(nvidia-smi --list-gpus | wc -l)
    [ "$NGPU" -ge 1 ] || { echo "no GPU: use '$0 cpu'" >&2; exit 2; }
    GPUS=0; [ "$NGPU" -ge 2 ] && GPUS=0,1
    PER_GPU=$(( 4 / (NGPU >= 2 ? 2 : 1) ))             # workers sharing one GPU
    FRACTION=$(awk "BEGIN {print 0.6 / $PER_GPU}")      # of the memory free after the weights
    WORKER_ARGS=(--gpu-memory-fraction "$FRACTION")
    PROFILE_ARGS=(--prefill-tokens 256,512,768,1024,2048 --decode-batches 1,8,32 --decode-contexts 512,1024
                  --repeats 2 --decode-steps 4)
    [ "$MODE" = gpu-smoke ] && PROFILE_ARGS=(--prefill-tokens 512,1024 --decode-batches 1,8 --decode-contexts 1024
                                             --repeats 1 --decode-steps 2)
    LINKS_ARGS=(--device cuda --transfers 3 --seconds 0.5)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    ;;
  cpu)
    SPEC=experiments/gpu-grid-cpu.yaml; STATE=results/gpu-grid-cpu-state; OUT=results/gpu-grid-cpu
    MODEL=random:smollm2-135m; GPUS=""
    WORKER_ARGS=(--device cpu --kv-cache-gib 0.2)
    PROFILE_ARGS=(--device cpu --kv-cache-gib 0.2 --prefill-tokens 32,64,128 --decode-batches 1,2,4
                  --decode-contexts 64,128 --repeats 1 --decode-steps 2)
    LINKS_ARGS=(--device cpu --transfers 2 --seconds 0.5 --min-mb 0.5)
    export OMP_NUM_THREADS=1
    ;;
  *) echo "usage: $0 [gpu|gpu-smoke|cpu]" >&2; exit 2 ;;
esac

# The spec's launch command says `python3`; make that this interpreter.
SHIM=$(mktemp -d)
printf '#!/bin/sh\nexec "%s" "$@"\n' "$(command -v "$PY")" > "$SHIM/python3"  # not a link: a venv must stay one
chmod +x "$SHIM/python3"
export PATH="$SHIM:$PATH"
WORKERS_PID=""
cleanup() {
  if [ -n "$WORKERS_PID" ] && kill -0 "$WORKERS_PID" 2>/dev/null; then
    kill -TERM "$WORKERS_PID"; wait "$WORKERS_PID" || true
  fi
  rm -rf "$SHIM"
}
trap cleanup EXIT

rm -rf "$STATE" "$OUT"
mkdir -p "$STATE"
start=$(date +%s)
if [ -n "${PROFILE:-}" ]; then
  cp "$PROFILE" "$STATE/profile.json"
  echo "profile: $PROFILE (given)"
else
  echo "profile: measuring ($MODEL)"
  CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=${GPUS%%,*} python3 -m pdserve.launcher.cli profile --model "$MODEL" --out "$STATE/profile.json" \
    -q "${PROFILE_ARGS[@]}"
fi
echo "profile done at +$(( $(date +%s) - start ))s"

# links: the spec's SET rates (each bandwidth, and its --slow-factor share) and --burst, paced on a
# bare link before anything else uses the GPU
read -r -a LINK_RATES <<< "$(python3 -m experiments.grid_link_rates "$SPEC")"
echo "links: pacing check, bench_pacing.py --rates ${LINK_RATES[*]}"
rc=0
CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=${GPUS%%,*} timeout -k 10 "${LINKS_TIMEOUT_S:-90}" \
  python3 -m benchmarks.bench_pacing "${LINKS_ARGS[@]}" --rates "${LINK_RATES[@]}" > "$STATE/pacing.txt" 2>&1 || rc=$?
[ "$rc" -eq 0 ] || echo "bench_pacing exited with $rc (124: stopped after ${LINKS_TIMEOUT_S:-90} s)" >> "$STATE/pacing.txt"
cat "$STATE/pacing.txt"
echo "links done at +$(( $(date +%s) - start ))s"

python3 -m pdserve.launcher.paced workers --state "$STATE" --model "$MODEL" --gpus "$GPUS" -- "${WORKER_ARGS[@]}" \
  > "$STATE/workers.out" 2>&1 &
WORKERS_PID=$!
until [ -f "$STATE/cluster.json" ]; do
  if ! kill -0 "$WORKERS_PID" 2>/dev/null; then
    echo "workers failed to start:" >&2; tail -n 20 "$STATE/workers.out" "$STATE"/*.log >&2 || true; exit 1
  fi
  sleep 1
done
echo "workers up at +$(( $(date +%s) - start ))s"

left=$(( ${DEADLINE_S:-500} - ($(date +%s) - start) ))
[ "$left" -gt 10 ] || { echo "no time left for the sweep (DEADLINE_S=${DEADLINE_S:-500})" >&2; exit 1; }
rc=0
timeout -s INT -k 30 "$left" python3 -m pdserve.loadgen.cli experiment "$SPEC" --output-dir "$OUT" || rc=$?
case $rc in
  0) echo "grid done at +$(( $(date +%s) - start ))s" ;;
  124|130) echo "grid stopped at the deadline (+$(( $(date +%s) - start ))s): analysing the runs done" ;;
  *) echo "loadgen exited with $rc" >&2 ;;
esac

mkdir -p "$OUT/cluster"
cp "$STATE/profile.json" "$STATE/links.jsonl" "$STATE/cluster.json" "$STATE/pacing.txt" "$OUT/cluster/"
[ -f "$STATE/gpu_samples.csv" ] && cp "$STATE/gpu_samples.csv" "$OUT/cluster/"
for log in "$STATE"/*.log "$STATE/workers.out"; do tail -n 40 "$log" > "$OUT/cluster/$(basename "$log").tail"; done
python3 -m experiments.analyze_grid "$OUT"
echo "all done in $(( $(date +%s) - start ))s; results in $OUT"
