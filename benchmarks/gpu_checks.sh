#!/usr/bin/env bash
# The GPU checks in one run, within a time budget:
#   1. the DNN benchmark on CUDA (SimpleCNN at the paper's 5 local epochs, ResNet18-GN; both engines; then
#      the vectorized engine's FedPM/FedAvg over more rounds),
#   2. the vectorized engine's CUDA-graph solve tests (which skip on a CPU), the convex benchmark with
#      --device cuda and the fedconvex tests that touch CuPy,
#   3. a real 100-round CIFAR-10 alpha=0.1 FedPM run (full data, paper preset), to the deadline.
#
#   bash benchmarks/gpu_checks.sh DATA_DIR OUT_DIR [SECONDS]
#
# DATA_DIR holds cifar10_jpeg_{train,test}.zip; OUT_DIR receives log.txt, the benchmark JSONs and the
# run's history.csv / summary.json.  SECONDS (default 570) is the whole budget: the 100-round run gets
# what the checks before it leave, and a run cut short keeps every completed round (continue it with
# the same command plus --resume).  Steps are independent: one failing does not stop the others.
set -u
DATA=${1:?usage: gpu_checks.sh DATA_DIR OUT_DIR [SECONDS]}
OUT=${2:?usage: gpu_checks.sh DATA_DIR OUT_DIR [SECONDS]}
BUDGET=${3:-570}
PY=${PYTHON:-python3}
RUN=${RUN_DIR:-$OUT/run100}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FEDPM_CACHE=${FEDPM_CACHE:-$OUT/cache}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() { echo; echo "=== $1 (t=$(( $(date +%s) - START ))s)"; }
exec > >(tee -a "$OUT/log.txt") 2>&1

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import sys, numpy, torch; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
$PY -c "import cupy; print('cupy', cupy.__version__)" || echo "cupy: not importable"

step "DNN benchmark on CUDA, the paper's 5 local epochs: python -m validation.bench_dnn --device cuda --json --models cnn"
timeout 200 $PY -m validation.bench_dnn --device cuda --json --models cnn --sizes 10,5000,5,2 --repeats 1 \
    > "$OUT/bench_dnn_cuda_cnn.json" || echo "bench_dnn cnn failed rc=$?"
cat "$OUT/bench_dnn_cuda_cnn.json"; echo

step "FedPM/FedAvg on the vectorized engine over 4 timed rounds each: python -m validation.bench_dnn --engines vectorized"
# one timed round per method above is noisy on shared cards (FedAvg rounds of the same code: 1.69-2.66 s);
# FEDPM_CUDA_GRAPHS=0 in front of this command measures the eager solves instead
timeout 120 $PY -m validation.bench_dnn --device cuda --json --models cnn --engines vectorized --sizes 10,5000,5,3 \
    --repeats 2 > "$OUT/bench_dnn_cuda_cnn_vectorized.json" || echo "bench_dnn vectorized failed rc=$?"
cat "$OUT/bench_dnn_cuda_cnn_vectorized.json"; echo

step "CUDA-graph solves against eager and sequential replies (skipped without a GPU): tests/test_vectorized.py -k cuda_graph"
timeout 90 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vectorized.py -k "cuda_graph" \
    || echo "cuda graph tests failed rc=$?"

step "convex on CuPy: python -m validation.bench_convex --device cuda --all-methods --json"
timeout 200 $PY -m validation.bench_convex --device cuda --all-methods --json > "$OUT/bench_convex_cupy.json" \
    || echo "bench_convex cupy failed rc=$?"
cat "$OUT/bench_convex_cupy.json"; echo
step "fedconvex tests that touch CuPy"
timeout 90 $PY -m pytest -q -p no:cacheprovider tests/test_every_method.py tests/test_generic_backend.py -k "cupy or backend" \
    || echo "cupy tests failed rc=$?"

step "DNN benchmark on CUDA: ResNet18-GN at CIFAR-100 size (10 clients, 200 images each, 1 epoch)"
timeout 100 $PY -m validation.bench_dnn --device cuda --json --models resnet18gn --sizes 10,200,1,2 --repeats 1 \
    > "$OUT/bench_dnn_cuda_resnet.json" || echo "bench_dnn resnet failed rc=$?"
cat "$OUT/bench_dnn_cuda_resnet.json"; echo

step "100-round CIFAR-10 alpha=0.1 FedPM, full data, paper preset ($(left)s left)"
RESUME=""
[ -f "$RUN/checkpoint.pt" ] && RESUME="--resume"
timeout $(( $(left) - 10 )) $PY -m validation.dnn --dataset cifar10 --data-dir "$DATA" --model cnn --method fedpm \
    --preset cifar10-a0.1 --alpha 0.1 --clients 10 --rounds 100 --seed 0 --device cuda --out "$RUN" $RESUME \
    || echo "run stopped rc=$? (124: budget reached; rerun with the same command to --resume)"
cp "$RUN/history.csv" "$RUN/summary.json" "$OUT/" 2>/dev/null
tail -n 3 "$OUT/history.csv" 2>/dev/null
step "done"

# ==================================================================================================================
# Last step: the paper sweep, budgeted (python -m validation.experiments --profile paper --budget-minutes M).
# It spends what the steps above leave on the paper's runs in their priority order (Table 3's CIFAR-10 alpha=0.1
# column first) and stops cleanly: a run cut short keeps its checkpointed rounds.  SWEEP_RESULTS (default
# results) is the results folder the sweep continues; the paper profile's folder is copied to OUT/paper
# (history.csv, summary.json, and checkpoint.pt of the partial runs, which the next call needs to continue them).
SWEEP=${SWEEP_RESULTS:-results}
MINUTES=$(( ($(left) - 40) / 60 ))
step "paper sweep, budgeted: python -m validation.experiments --profile paper --budget-minutes $MINUTES"
if [ "$MINUTES" -ge 2 ]; then
    timeout $(( $(left) - 5 )) $PY -m validation.experiments --profile paper --data-dir "$DATA" --results "$SWEEP" \
        --budget-minutes "$MINUTES" || echo "sweep stopped rc=$?"
    $PY -m validation.experiments --profile paper --results "$SWEEP" --list | grep -v "^missing" | tail -n 40
    mkdir -p "$OUT/paper" && cp -r "$SWEEP/paper/." "$OUT/paper/" 2>/dev/null
else
    echo "skipped: under 2 minutes left"
fi
step "sweep done"
