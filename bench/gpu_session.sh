#!/usr/bin/env bash
# Issue #17's GPU measurements in one command, for a session that is lent a GPU machine (the device tool):
#
#   bash bench/gpu_session.sh            # from the repository root; logs and figures under $OUT (default /tmp/gpu-out)
#   STEPS="train train_eager" MB_TOKENS="16384 24576" bash bench/gpu_session.sh   # the trainer alone, an H100's budgets
#
# On the device machine the project is not installed: its Python packages that the machine's image lacks travel as
# wheels in .whl/ and are installed into /tmp/site; the repository root goes on PYTHONPATH. The wheels, for its
# Python 3.12 (drop those the image has: prefect's dependencies include many it has):
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
#       --platform manylinux_2_28_x86_64 [--platform manylinux_2_N_x86_64 ...] -c constraints.txt -d .whl \
#       prefect==3.9.1 omegaconf math-verify pebble setproctitle "fastapi<0.151" "sqlalchemy[asyncio]<2.1"
# (the train steps alone need omegaconf antlr4-python3-runtime math-verify latex2sympy2_extended pebble setproctitle
# orjson datasets dill multiprocess)
# On a GPU machine of your own, `pip install -e .` instead, and run the steps' commands as they are.
# Steps, each under its own time limit, each one's output in $OUT/<step>.log (the last lines printed here):
#   train     bench/train_throughput.py: a Qwen2.5-0.5B-shaped model, bf16 FSDP2 on one GPU, 64 packed 4096-token
#             rows at mb_max_tokens 16384 and 32768: tokens/s, MFU, peak memory; a profiled update's operator table
#   train_eager  the same at the first budget without compiled decoder layers (trainer.compile_layers=false)
#   plain     bench/time_to_reward.py: the RL loop of configs/tiny_cpu.yaml (100 iterations), trainer and the
#             project's server colocated on the one GPU; then `evaluate` loads its last checkpoint on the GPU
#   rollout   bench/rollout_throughput.py: the project's server on the GPU (bf16, 0.5B shape, 64 concurrent
#             requests) against model.generate on the same GPU
#   flow      `areal-pipeline train` (the Prefect flow, its temporary API server included), 20 iterations on the
#             GPU, colocated, weights pushed by a process group (gloo: NCCL refuses two members on one GPU)
#   resume    the same run continued to 25 iterations by a new command: its trainer loads the checkpoint of
#             iteration 20 (weights, optimizer, RNG) on the GPU
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false DO_NOT_TRACK=1 \
    PREFECT_HOME=/tmp/gpu-prefect-home PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
PY=${PYTHON:-python3}
WORK=/tmp/gpu-work
rm -rf "$WORK" && mkdir -p "$WORK"

step() {  # step NAME SECONDS COMMAND...: run it, keep its log, print its last lines (skipped unless in $STEPS)
    local name=$1 limit=$2
    shift 2
    case " ${STEPS:-train train_eager plain evaluate rollout flow resume} " in *" $name "*) ;; *) return 0 ;; esac
    echo "=== $name ($(date +%T), limit ${limit}s)"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "--- $name: rc=$rc in $((SECONDS - start))s"
    grep -v "^Writing model shards\|it/s\]" "$OUT/$name.log" | tail -n "${TAIL:-6}"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/env.log"

# One 0.5B-shaped model (random weights, byte tokenizer) for the trainer and the server benchmarks.
$PY -c "
import sys; sys.path.insert(0, 'bench')
from pathlib import Path
from train_throughput import build_model
build_model('qwen2.5-0.5b', Path('$WORK/qwen05'))" >>"$OUT/env.log" 2>&1 || echo "model build failed"

# MB_TOKENS: the micro-batch budgets (32768 needs more than an H100's 80 GB); train_eager: the same without the
# compiled decoder layers (trainer.compile_layers=false), the baseline of the compiled ones
MB_TOKENS=${MB_TOKENS:-16384 32768}
TAIL=8 step train 300 $PY bench/train_throughput.py --device cuda --model "$WORK/qwen05" --min-len 4096 \
    --max-len 4096 --trajectories 64 --mb-max-tokens $MB_TOKENS --variants packed_1rank --updates 2 \
    --profile-dir "$WORK/prof"
TAIL=4 step train_eager 200 $PY bench/train_throughput.py --device cuda --model "$WORK/qwen05" --min-len 4096 \
    --max-len 4096 --trajectories 64 --mb-max-tokens ${MB_TOKENS%% *} --variants packed_1rank --updates 2 \
    trainer.compile_layers=false
for table in "$WORK"/prof/*/train-iter*-rank0.txt; do echo "== $table"; cat "$table"; done >"$OUT/profile.txt" 2>/dev/null

GPU_RUN=(trainer.device=cuda inference.device=cuda inference.dtype=bfloat16 trainer.colocate=true
         inference.sglang.mem_fraction_static=0.3 trainer.memory_fraction=0.5 output_dir="$WORK/runs")
step plain 150 $PY bench/time_to_reward.py "${GPU_RUN[@]}" run_id=gpu-plain total_iterations=100
TAIL=4 step evaluate 60 $PY -m cli evaluate --run-id gpu-plain "${GPU_RUN[@]}"

step rollout 120 $PY bench/rollout_throughput.py --device cuda --dtype bfloat16 --model "$WORK/qwen05" \
    --new-tokens 128 --repeats 3 --sequential-requests 4

TAIL=12 step flow 150 $PY -m cli train --config configs/tiny_cpu.yaml "${GPU_RUN[@]}" run_id=gpu-flow \
    total_iterations=20 trainer.weight_sync=distributed
TAIL=8 step resume 120 $PY -m cli train --config configs/tiny_cpu.yaml "${GPU_RUN[@]}" run_id=gpu-flow \
    total_iterations=25 trainer.weight_sync=distributed
# its update of iteration 21 needs the trainer at version 20: a trainer that did not load the checkpoint fails it
echo "iterations recorded: $(wc -l <"$WORK/runs/gpu-flow/metrics.jsonl")"
echo "=== done ($(date +%T))"
