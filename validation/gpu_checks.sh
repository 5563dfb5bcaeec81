#!/usr/bin/env bash
# Every GPU check in one run, within a time budget, resumable:
#   1. the DNN benchmark on CUDA (SimpleCNN at the paper's 5 local epochs, ResNet18-GN; both engines; then
#      the vectorized engine's FedPM/FedAvg over more rounds),
#   2. the vectorized engine's CUDA-graph solve tests (which skip on a CPU), the convex benchmark with
#      --device cuda and the fedconvex tests that touch CuPy,
#   3. runs as a batch axis and the FOOF inverse (docs/stacking.md): the --foof-apply tests on CUDA, the stack
#      benchmark at S = 1, 3, 6, 12 for SimpleCNN with CUDA graphs on and off, ResNet18-GN's FedPM/FedAvg with
#      both applies, the server mixing's earlier form against the Cholesky kernel on ResNet18-GN's blocks,
#   4. FedPM and FedAvg on CIFAR-10 alpha=0.1, seeds 0-2, 100 rounds, full data, paper preset, as two stacks,
#      to the deadline,
#   5. the paper sweep, budgeted, with whatever time is left.
#
#   bash validation/gpu_checks.sh DATA_DIR OUT_DIR [SECONDS] [PREVIOUS_OUT]
#
# DATA_DIR holds cifar10_jpeg_{train,test}.zip; OUT_DIR receives log.txt, the benchmark JSONs and the runs'
# folders (history.csv, summary.json, checkpoint.pt).  SECONDS (default 570) is the whole budget.  Every step
# that finishes leaves OUT_DIR/done/<step>; a second call with the same OUT_DIR -- or with a fresh OUT_DIR and
# the first call's output as PREVIOUS_OUT, copied in first -- skips the finished steps and continues the runs
# from their checkpoints (--resume), so the budget goes where the first call stopped.  Steps are independent:
# one failing does not stop the others.
set -u
DATA=${1:?usage: gpu_checks.sh DATA_DIR OUT_DIR [SECONDS] [PREVIOUS_OUT]}
OUT=${2:?usage: gpu_checks.sh DATA_DIR OUT_DIR [SECONDS] [PREVIOUS_OUT]}
BUDGET=${3:-570}
PREV=${4:-}
PY=${PYTHON:-python3}
mkdir -p "$OUT/done"
if [ -n "$PREV" ] && [ -d "$PREV" ] && [ "$(cd "$PREV" && pwd)" != "$(cd "$OUT" && pwd)" ]; then
    cp -R "$PREV"/. "$OUT"/   # the earlier call's results, markers and checkpoints
    chmod -R u+w "$OUT"
fi
export PYTHONUNBUFFERED=1 FEDPM_CACHE=${FEDPM_CACHE:-$HOME/.cache/fedpm}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() { echo; echo "=== $1 (t=$(( $(date +%s) - START ))s)"; }
done_() { [ -f "$OUT/done/$1" ]; }             # finished in this or an earlier call
mark() { date -u +%FT%TZ > "$OUT/done/$1"; }
exec > >(tee -a "$OUT/log.txt") 2>&1

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import sys, numpy, torch; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
$PY -c "import cupy; print('cupy', cupy.__version__)" || echo "cupy: not importable"
git log -1 --format='commit %H %cd' 2>/dev/null || true

if ! done_ dnn_bench; then
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
timeout 90 $PY -m pytest -q -p no:cacheprovider tests/test_every_method.py tests/test_generic_backend.py tests/test_mixing.py -k "cupy or backend" \
    || echo "cupy tests failed rc=$?"

step "DNN benchmark on CUDA: ResNet18-GN at CIFAR-100 size (10 clients, 200 images each, 1 epoch)"
timeout 100 $PY -m validation.bench_dnn --device cuda --json --models resnet18gn --sizes 10,200,1,2 --repeats 1 \
    > "$OUT/bench_dnn_cuda_resnet.json" || echo "bench_dnn resnet failed rc=$?"
cat "$OUT/bench_dnn_cuda_resnet.json"; echo

mark dnn_bench
fi

step "--foof-apply on CUDA: inverse against solve within the float32 bound (tests/test_foof_apply.py, TF32 off)"
if ! done_ foof_apply_tests; then
    timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_foof_apply.py tests/test_run_stack.py -k "not cli" \
        && mark foof_apply_tests || echo "foof-apply / stack tests failed rc=$?"
fi

step "FOOF apply per block on CUDA: python benchmarks/foof_apply.py --device cuda --clients 10"
if ! done_ foof_apply_bench; then
    timeout 120 $PY benchmarks/foof_apply.py --device cuda --clients 10 --json "$OUT/foof_apply_cuda.json" \
        && mark foof_apply_bench || echo "foof apply benchmark failed rc=$?"
fi

step "FedPM's server mixing on CUDA, earlier form against precond_mix now: python benchmarks/mixing_solve_forms.py --device cuda --clients 10"
if ! done_ mixing_forms; then
    timeout 150 $PY benchmarks/mixing_solve_forms.py --device cuda --clients 10 --repeats 3 --json \
        > "$OUT/mixing_solve_forms_cuda.json" && mark mixing_forms || echo "mixing forms benchmark failed rc=$?"
    cat "$OUT/mixing_solve_forms_cuda.json"; echo
fi

# runs as a batch axis: SimpleCNN at the paper's size, one run alone against S stacked, CUDA graphs on and off
for S in 1 3 6 12; do
    for GRAPHS in 1 0; do
        name=stack_cnn_S${S}_graphs${GRAPHS}
        done_ $name && continue
        [ "$(left)" -lt 150 ] && { echo "skipping $name: $(left)s left"; continue; }
        step "python -m validation.bench_dnn --device cuda --models cnn --engines vectorized --sizes 10,5000,5,2 --repeats 1 --stack $S (FEDPM_CUDA_GRAPHS=$GRAPHS)"
        FEDPM_CUDA_GRAPHS=$GRAPHS timeout $(( $(left) - 60 )) $PY -m validation.bench_dnn --device cuda --json \
            --models cnn --engines vectorized --sizes 10,5000,5,2 --repeats 1 --stack $S --foof-applies solve,inverse \
            > "$OUT/$name.json" && mark $name || echo "$name failed rc=$? (S=12 may not fit: its JSON is empty)"
        cat "$OUT/$name.json"; echo
    done
done

step "ResNet18-GN FedPM/FedAvg with --foof-apply solve and inverse (10 clients x 1,000 images x 1 epoch, projected to the paper's size)"
if ! done_ resnet_applies && [ "$(left)" -gt 150 ]; then
    timeout $(( $(left) - 60 )) $PY -m validation.bench_dnn --device cuda --json --models resnet18gn \
        --engines vectorized --sizes 10,1000,1,2 --repeats 1 --foof-applies solve,inverse \
        > "$OUT/bench_dnn_cuda_resnet_applies.json" && mark resnet_applies || echo "resnet applies failed rc=$?"
    cat "$OUT/bench_dnn_cuda_resnet_applies.json"; echo
fi

# the paper's CIFAR-10 alpha=0.1 runs, seeds 0-2, as two stacks of three; each run checkpoints every round under
# $OUT/stacks/main-cifar10-a0.1-<method>-s<seed>/ and the next call resumes it
for METHOD in fedpm fedavg; do
    done_ stack_$METHOD && continue
    [ "$(left)" -lt 60 ] && { echo "skipping the $METHOD stack: $(left)s left"; continue; }
    step "100-round CIFAR-10 alpha=0.1 $METHOD, seeds 0,1,2 as one stack, full data, paper preset ($(left)s left)"
    RESUME=""
    ls "$OUT"/stacks/main-cifar10-a0.1-$METHOD-s*/checkpoint.pt > /dev/null 2>&1 && RESUME="--resume"
    timeout $(( $(left) - 20 )) $PY -m validation.dnn --dataset cifar10 --data-dir "$DATA" --model cnn \
        --method $METHOD --preset cifar10-a0.1 --alpha 0.1 --clients 10 --rounds 100 --seeds 0,1,2 --device cuda \
        --foof-apply auto --quiet --out "$OUT/stacks" $RESUME \
        && mark stack_$METHOD || echo "$METHOD stack stopped rc=$? (124: budget reached; the next call resumes it)"
    for d in "$OUT"/stacks/main-cifar10-a0.1-$METHOD-s*; do
        [ -f "$d/history.csv" ] && echo "$d: $(tail -n 1 "$d/history.csv")"
    done
done
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
