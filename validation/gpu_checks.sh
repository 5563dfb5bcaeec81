#!/usr/bin/env bash
# The GPU figures of the FOOF throughput work, most important first, each in its own file under OUT_DIR, then the
# 100-round CIFAR-10 SimpleCNN stacks (3 seeds each) with the time left:
#    1. --foof-precision on CUDA: each mode against float64 within its bound (tests/test_foof_precision.py, TF32 off
#       outside the modes' own products)                                                  -> precision_tests.txt
#    2. ResNet18-GN, 10 clients x 1,000 images x 1 epoch, FedPM (inverse, split-tf32) / FedAvg, with the clients per
#       chunk the engine chose and the peak memory                                        -> resnet_split_tf32.json
#    3. SimpleCNN at the paper's size (10 x 5,000 x 5), vectorized, FedPM inverse and solve / FedAvg, with the
#       operator and launch counts per local step, the loop's and the graphed step's (--proxies)
#                                                                                         -> cnn_paper.json
#    4. SimpleCNN FedAvg and FedPM rounds at the paper's size with --step-graph on against off, and the first
#       round's parameters of the two within float tolerance (exit 1 where not)          -> step_graph.json
#    5. ResNet18-GN as in 2 with --foof-precision fp32 (what split-tf32 gains)            -> resnet_fp32.json
#    5a. every FOOF Gram form (full, half, row) timed on the device beside the form the CUDA rule picks (its two
#       costs are estimates until this measures them)                                      -> foof_gram_forms.txt
#    6. six SimpleCNN FedPM runs stacked against one alone, the paper's size              -> stack6_cnn.json
#    7. torch.profiler of a SimpleCNN FedAvg and FedPM round                              -> cuda_round_profile.txt
#    8. the --foof-apply, CUDA-graph and step-graph tests on CUDA                         -> cuda_tests.txt
#    9. the stacks, each a unit of its own (one 10-minute job each, resumable):
#       stack_fedavg_a1.0, stack_fedpm_a1.0   (--preset cifar10-a1.0)
#       stack_fedpm_a0.1_even, stack_fedavg_a0.1_even   (--preset cifar10-a0.1 --split relaysum-even)
#       each run's folder under OUT_DIR/stacks/ (history.csv, summary.json, checkpoint.pt)
#
#   bash validation/gpu_checks.sh DATA_DIR OUT_DIR [SECONDS] [PREVIOUS_OUT]
#   ONLY=stack_fedpm_a1.0 bash validation/gpu_checks.sh DATA_DIR OUT_DIR 570 PREVIOUS_OUT   # one unit alone
#   GPU_CHECKS_TINY=1 bash validation/gpu_checks.sh DATA_DIR OUT_DIR   # every step at a tiny size on the CPU
#
# DATA_DIR holds CIFAR-10 (cifar10_jpeg_{train,test}.zip or cifar-10-batches-py); SECONDS (default 540) is the whole
# budget.  Every finished step leaves OUT_DIR/done/<step>; a second call with the same OUT_DIR -- or a fresh one
# with the first call's output as PREVIOUS_OUT, copied in first -- skips the finished steps and resumes the stacks
# from their checkpoints.  Steps are independent: one failing does not stop the others.  The tiny mode
# (GPU_CHECKS_TINY=1) runs on the CPU with SimpleCNN in place of ResNet18-GN, a few images, one round of each stack,
# and without the CUDA-only tests: it checks the script, not the figures (tests/test_benchmarks_run.py runs it).
set -u
DATA=${1:?usage: gpu_checks.sh DATA_DIR OUT_DIR [SECONDS] [PREVIOUS_OUT]}
OUT=${2:?usage: gpu_checks.sh DATA_DIR OUT_DIR [SECONDS] [PREVIOUS_OUT]}
BUDGET=${3:-540}
PREV=${4:-}
PY=${PYTHON:-python3}
ONLY=${ONLY:-}
mkdir -p "$OUT/done"
if [ -n "$PREV" ] && [ -d "$PREV" ] && [ "$(cd "$PREV" && pwd)" != "$(cd "$OUT" && pwd)" ]; then
    cp -R "$PREV"/. "$OUT"/   # the earlier call's results, markers and checkpoints
    chmod -R u+w "$OUT"
fi
export PYTHONUNBUFFERED=1
if [ "${GPU_CHECKS_TINY:-0}" = 1 ]; then
    DEV=cpu; RESNET=cnn; CNN_PAPER=2,16,1,2; RESNET_SIZE=2,8,1,2; STACK=2; ROUNDS=1
    SKIP_TINY="precision_tests resnet_fp32 cuda_tests"   # CUDA-only tests, and a repeat of step 2 at this size
    RUN_SIZE=(--clients 2 --train-subset 40 --test-subset 20 --local-epochs 1 --threads 1)
    export OMP_NUM_THREADS=1
else
    DEV=cuda; RESNET=resnet18gn; CNN_PAPER=10,5000,5,2; RESNET_SIZE=10,1000,1,2; STACK=6; ROUNDS=100
    RUN_SIZE=(); SKIP_TINY=""
fi
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() { echo; echo "=== $1 (t=$(( $(date +%s) - START ))s, $(left)s left)"; }
done_() { [ -f "$OUT/done/$1" ]; }
mark() { date -u +%FT%TZ > "$OUT/done/$1"; }
# run STEP SECONDS FILE COMMAND...: once (a done marker), in the budget, its output into OUT/FILE
run() {
    local name=$1 need=$2 file=$3; shift 3
    if [ -n "$ONLY" ] && [ "$ONLY" != "$name" ]; then return; fi
    case " $SKIP_TINY " in *" $name "*) echo "$name: not in the tiny mode"; return ;; esac
    done_ "$name" && { echo "$name: done earlier"; return; }
    if [ "$(left)" -lt "$need" ]; then echo "skipping $name: $(left)s left, needs ~${need}s"; return; fi
    step "$name: $*"
    if timeout $(( $(left) - 5 )) "$@" > "$OUT/$file"; then mark "$name"; else echo "$name failed rc=$?"; fi
    tail -c 2000 "$OUT/$file"; echo
}
exec > >(tee -a "$OUT/log.txt") 2>&1

step "machine"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
git log -1 --format='commit %H %cd' 2>/dev/null || true

BENCH=($PY -m validation.bench_dnn --device $DEV --json --repeats 1 --threads 1)
run precision_tests 60 precision_tests.txt $PY -m pytest -q -p no:cacheprovider -rs tests/test_foof_precision.py -k cuda
run resnet_split_tf32 150 resnet_split_tf32.json "${BENCH[@]}" --models $RESNET --engine vectorized \
    --sizes $RESNET_SIZE --foof-apply inverse --foof-precision split-tf32
run cnn_paper 150 cnn_paper.json "${BENCH[@]}" --models cnn --engine vectorized --sizes $CNN_PAPER \
    --foof-apply inverse,solve --proxies
run step_graph 90 step_graph.json $PY benchmarks/step_graph_round.py --device $DEV --sizes $CNN_PAPER
run resnet_fp32 150 resnet_fp32.json "${BENCH[@]}" --models $RESNET --engine vectorized --sizes $RESNET_SIZE \
    --foof-apply inverse --foof-precision fp32
run gram_forms 60 foof_gram_forms.txt $PY benchmarks/foof_gram_forms.py --device $DEV \
    $([ $DEV = cpu ] && echo --clients 1 --images 4 --models cnn)
run stack6_cnn 150 stack6_cnn.json "${BENCH[@]}" --models cnn --engine vectorized --sizes $CNN_PAPER \
    --method fedpm --foof-apply inverse --stack $STACK
run round_profile 90 cuda_round_profile.txt $PY benchmarks/cuda_round_profile.py \
    "$([ $DEV = cpu ] && echo 8 || echo 5000)" --device $DEV --clients "$([ $DEV = cpu ] && echo 1 || echo 10)"
run cuda_tests 120 cuda_tests.txt $PY -m pytest -q -p no:cacheprovider -rs tests/test_foof_apply.py \
    tests/test_vectorized.py tests/test_step_graph.py -k "cuda"

# the 100-round stacks: 3 seeds of one method and setting trained together, checkpointing every round, resumable
stack() {
    local name=$1 method=$2 preset=$3; shift 3
    if [ -n "$ONLY" ] && [ "$ONLY" != "$name" ]; then return; fi
    done_ "$name" && { echo "$name: done earlier"; return; }
    [ "$(left)" -lt 60 ] && { echo "skipping $name: $(left)s left"; return; }
    local out="$OUT/stacks/$name" resume=""
    ls "$out"/*/checkpoint.pt > /dev/null 2>&1 && resume="--resume"
    step "$name: $method $preset $* seeds 0,1,2, $ROUNDS rounds ($resume)"
    timeout $(( $(left) - 10 )) $PY -m validation.dnn --dataset cifar10 --data-dir "$DATA" --model cnn \
        --method "$method" --preset "$preset" "$@" --rounds $ROUNDS --seeds 0,1,2 --device $DEV --quiet \
        "${RUN_SIZE[@]}" --out "$out" $resume \
        && mark "$name" || echo "$name stopped rc=$? (124: budget reached; the next call resumes it)"
    for d in "$out"/*/; do [ -f "$d/history.csv" ] && echo "$d: $(tail -n 1 "$d/history.csv")"; done
}
stack stack_fedavg_a1.0 fedavg cifar10-a1.0
stack stack_fedpm_a1.0 fedpm cifar10-a1.0
stack stack_fedpm_a0.1_even fedpm cifar10-a0.1 --split relaysum-even
stack stack_fedavg_a0.1_even fedavg cifar10-a0.1 --split relaysum-even
step "done"
