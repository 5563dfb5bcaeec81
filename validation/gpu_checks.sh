#!/usr/bin/env bash
# The GPU figures of the FOOF throughput work, most important first, each in its own file of the archive, then the
# 100-round CIFAR-10 SimpleCNN stacks (3 seeds each) with the time left:
#    1. --foof-precision on CUDA: each mode against float64 within its bound (tests/test_foof_precision.py, TF32 off
#       outside the modes' own products), and by how much each check passed                -> precision_tests.txt,
#                                                                                            precision_margins.txt
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
#       stack_fedavg_a1.0, stack_fedavg_a1.0_keep, stack_fedpm_a1.0   (--preset cifar10-a1.0: the presets drop an
#       epoch's last partial batch; the _keep unit steps on it, --last-batch keep, so that the first two are the pair
#       that sizes the single-image step at the paper's length, REPRODUCTION.md section 3a)
#       stack_fedpm_a0.1_even, stack_fedavg_a0.1_even   (--preset cifar10-a0.1 --split relaysum-even)
#       each run's folder under stacks/ (history.csv, summary.json, checkpoint.pt)
#
#   bash validation/gpu_checks.sh DATA_DIR OUT_DIR [SECONDS] [PREVIOUS]
#   ONLY=stack_fedpm_a1.0 bash validation/gpu_checks.sh DATA_DIR OUT_DIR 540 PREVIOUS   # one unit alone
#   GPU_CHECKS_TINY=1 bash validation/gpu_checks.sh DATA_DIR OUT_DIR   # every step at a tiny size on the CPU
#
# DATA_DIR holds CIFAR-10 (cifar10_jpeg_{train,test}.zip or cifar-10-batches-py); SECONDS (default 540) is the whole
# budget.  The units work in a scratch folder (GPU_CHECKS_WORK, default a fresh temporary one) and every unit ends by
# refreshing ONE archive, OUT_DIR/results.tar.gz (at most 16 MiB: validation/gpu_archive.py), beside a copy of the
# log: all a job has to hand back.  PREVIOUS (the 4th argument or $PREVIOUS) is an earlier call's results.tar.gz, or
# its OUT_DIR; without it an OUT_DIR that already holds results.tar.gz continues from that.  A continued call skips
# the finished units (done/<unit> in the archive) and resumes the stacks from their checkpoints; it refuses, in one
# line, an archive measured on a device of another name (H100 and H200 figures are never mixed).  Steps are
# independent: one failing does not stop the others.  Without a CUDA device the script stops at once with one line
# and exit 2 (nothing written), unless GPU_CHECKS_TINY=1: SimpleCNN in place of ResNet18-GN, a few images, one
# round of each stack, without the CUDA-only tests; it checks the script, not the figures
# (tests/test_benchmarks_run.py runs it twice, the second call continuing from the first's archive).
set -u
USAGE="usage: gpu_checks.sh DATA_DIR OUT_DIR [SECONDS] [PREVIOUS]"
DATA=${1:?$USAGE}
OUT=${2:?$USAGE}
BUDGET=${3:-540}
PREV=${4:-${PREVIOUS:-}}
PY=${PYTHON:-python3}
ONLY=${ONLY:-}
TINY=${GPU_CHECKS_TINY:-0}
fail() { echo "gpu_checks.sh: $*" >&2; exit 2; }
case "$BUDGET" in ''|*[!0-9]*) fail "SECONDS must be a whole number of seconds, got '$BUDGET'" ;; esac
[ -d "$DATA" ] || fail "DATA_DIR $DATA: no such folder"
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
DATA=$(abs "$DATA"); OUT=$(abs "$OUT"); [ -z "$PREV" ] || PREV=$(abs "$PREV")
cd "$(dirname "$0")/.." || fail "cannot enter the repository"   # the benchmarks and tests are named from its root
DEVNAME=$($PY -m validation.gpu_archive device 2> /dev/null) || fail "$PY cannot import torch (set PYTHON to the project's Python)"
if [ "$TINY" != 1 ] && [ "$DEVNAME" = CPU ]; then
    fail "no CUDA device is visible (torch.cuda.is_available() is False): run it on a GPU machine, or with GPU_CHECKS_TINY=1 to check the script on the CPU"
fi
if [ -z "$PREV" ] && [ -f "$OUT/results.tar.gz" ]; then PREV=$OUT/results.tar.gz; fi
if [ -n "$PREV" ] && [ -d "$PREV" ]; then PREV=$PREV/results.tar.gz; fi
[ -z "$PREV" ] || [ -f "$PREV" ] || fail "PREVIOUS $PREV: no results.tar.gz there"
WORK=$(abs "${GPU_CHECKS_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_checks.XXXXXX")}")
mkdir -p "$OUT" "$WORK/done" || fail "cannot create $OUT or $WORK"
[ -n "${GPU_CHECKS_WORK:-}" ] || trap 'rm -rf "$WORK"' EXIT   # its own scratch folder: all of it is in the archive
if [ -n "$PREV" ]; then
    $PY -m validation.gpu_archive unpack "$PREV" "$WORK" "$DEVNAME" > /dev/null || exit 2
fi
ARCHIVE=$OUT/results.tar.gz
export PYTHONUNBUFFERED=1
if [ "$TINY" = 1 ]; then
    DEV=cpu; RESNET=cnn; CNN_PAPER=2,16,1,2; RESNET_SIZE=2,8,1,2; STACK=2; ROUNDS=1
    SKIP_TINY="precision_tests resnet_fp32 cuda_tests"   # CUDA-only tests, and a repeat of step 2 at this size
    RUN_SIZE=(--clients 2 --train-subset 40 --test-subset 20 --local-epochs 1 --threads 1)
    export OMP_NUM_THREADS=1
else
    DEV=cuda; RESNET=resnet18gn; CNN_PAPER=10,5000,5,2; RESNET_SIZE=10,1000,1,2; STACK=6; ROUNDS=100
    RUN_SIZE=(); SKIP_TINY=""
fi
START=$(date +%s)
UNIT_MAX=530   # seconds: a unit never takes more than one 9-minute job
PIECE_MARGIN=${PIECE_MARGIN:-60}   # a stack's round (3 SimpleCNN runs at the paper's size) and its checkpoint fit in it
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() { echo; echo "=== $1 (t=$(( $(date +%s) - START ))s, $(left)s left)"; }
done_() { [ -f "$WORK/done/$1" ]; }
mark() { date -u +%FT%TZ > "$WORK/done/$1"; }
# the unit's results into the one archive (the previous one stays where the new one would be over its limit)
refresh() { cp "$WORK/log.txt" "$OUT/log.txt"; $PY -m validation.gpu_archive pack "$WORK" "$ARCHIVE" "$DEVNAME"; }
# run STEP SECONDS FILE COMMAND...: once (a done marker), in the budget, its output into WORK/FILE, then the archive
run() {
    local name=$1 need=$2 file=$3; shift 3
    if [ -n "$ONLY" ] && [ "$ONLY" != "$name" ]; then return; fi
    case " $SKIP_TINY " in *" $name "*) echo "$name: not in the tiny mode"; return ;; esac
    done_ "$name" && { echo "$name: done earlier"; return; }
    if [ "$(left)" -lt "$need" ]; then echo "skipping $name: $(left)s left, needs ~${need}s"; return; fi
    step "$name: $*"
    local cap=$(( $(left) - 5 )); [ $cap -gt $UNIT_MAX ] && cap=$UNIT_MAX   # every unit fits one job
    if timeout $cap "$@" > "$WORK/$file"; then mark "$name"; else echo "$name failed rc=$?"; fi
    tail -c 2000 "$WORK/$file"; echo
    refresh
}
exec > >(tee -a "$WORK/log.txt") 2>&1
echo "device: $DEVNAME; work folder: $WORK; archive: $ARCHIVE${PREV:+; continued from $PREV}"

step "machine"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
git log -1 --format='commit %H %cd' 2>/dev/null || true

BENCH=($PY -m validation.bench_dnn --device $DEV --json --repeats 1 --threads 1)
run precision_tests 60 precision_tests.txt env FOOF_PRECISION_MARGINS="$WORK/precision_margins.txt" $PY -m pytest -q -p no:cacheprovider -rs tests/test_foof_precision.py -k cuda
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
    [ "$(left)" -lt $(( PIECE_MARGIN + 30 )) ] && { echo "skipping $name: $(left)s left"; return; }
    local out="$WORK/stacks/$name" resume="" rc=0
    ls "$out"/*/checkpoint.pt > /dev/null 2>&1 && resume="--resume"
    step "$name: $method $preset $* seeds 0,1,2, $ROUNDS rounds ($resume)"
    # a piece: rounds until PIECE_MARGIN seconds before the budget's end (--deadline: it stops after the round in
    # which the deadline passes, checkpointed, exit 75), with a hard stop 10 s before the end
    local span=$(left); [ $span -gt $UNIT_MAX ] && span=$UNIT_MAX
    timeout $(( span - 10 )) $PY -m validation.dnn --dataset cifar10 --data-dir "$DATA" --model cnn \
        --method "$method" --preset "$preset" "$@" --rounds $ROUNDS --seeds 0,1,2 --device $DEV --quiet \
        "${RUN_SIZE[@]}" --out "$out" $resume --deadline $(( $(date +%s) + span - PIECE_MARGIN )) || rc=$?
    case $rc in
        0) mark "$name" ;;
        75|124) echo "$name: a piece done (rc=$rc), its last round checkpointed; a call given this archive resumes it" ;;
        *) echo "$name failed rc=$rc" ;;
    esac
    for d in "$out"/*/; do [ -f "$d/history.csv" ] && echo "$d: $(tail -n 1 "$d/history.csv")"; done
    refresh
}
stack stack_fedavg_a1.0 fedavg cifar10-a1.0
stack stack_fedavg_a1.0_keep fedavg cifar10-a1.0 --last-batch keep
stack stack_fedpm_a1.0 fedpm cifar10-a1.0
stack stack_fedpm_a0.1_even fedpm cifar10-a0.1 --split relaysum-even
stack stack_fedavg_a0.1_even fedavg cifar10-a0.1 --split relaysum-even
step "done"
refresh
