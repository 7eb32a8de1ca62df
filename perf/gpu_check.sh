#!/usr/bin/env bash
# perf/gpu_check.sh: everything GPU-only in one run, under 8 minutes on one H200, from a copy of
# the working tree: the CUDA tests (each Triton kernel against the torch reference, CUDA graphs,
# memory sizing, GGUF on CUDA), `pipeline-bench model` on random Llama-3-8B weights (prefill of 2k
# tokens; decode at batch 1, 64 and 256 as CUDA graphs and eagerly; batch 1 against the HBM
# roofline, weight and KV bytes / 4.8 TB/s, and each decode batch beside `pipeline-bench
# roofline`'s prediction for this GPU), and `pipeline-bench serve` at c=1 and c=256 against
# `pipeline-serve --random-weights llama-3-8b`. Writes gpu_check.json and gpu_check.md (one table
# per part, with the fraction reached of the issue's goals) and every step's log.
#
# Usage: perf/gpu_check.sh [--dry-run] [--cpu] [OUT_DIR]
#   OUT_DIR    where the results go (default: $OUT, else perf/results/gpu_check)
#   --dry-run  print each step's command instead of running it
#   --cpu      the same steps on CPU on a tiny random shape, in seconds (checks this script)
#
# The GPU machine has torch and triton but no other package and no network: the wheels travel in
# .whl/ (ignored by git). Fill it on a machine with network, from the repository root, with
#   make gpu-wheels            (PYTHON_VERSION=3.12 by default: the GPU machine's Python)
# which runs, for every NAME==VERSION that `python -m perf.gpu_wheels` prints (each runtime
# dependency and pytest's, except torch and triton, at the versions installed here):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl NAME==VERSION
# This script installs them with
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# and runs the tree's code with PYTHONPATH=<tree>:/tmp/site. Without .whl/ it uses the packages
# the Python it runs already has (as with --cpu here).
set -euo pipefail

DRY_RUN=0
DEVICE=cuda
OUT_DIR=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --cpu) DEVICE=cpu ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        -*) echo "gpu_check: unknown option $arg" >&2; exit 2 ;;
        *) OUT_DIR="$arg" ;;
    esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT_DIR="${OUT_DIR:-${OUT:-$ROOT/perf/results/gpu_check}}"
mkdir -p "$OUT_DIR/logs"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PY="${PYTHON:-python3}"
SITE="${SITE:-/tmp/site}"

if [ "$DEVICE" = cuda ]; then
    MODEL=llama-3-8b
    DECODE_BATCHES=(1 64 256)
    CONTEXT=512
    PREFILL=2048  # also the bench's max_model_len: its CUDA graphs' block tables are as wide
    MODEL_ARGS=(--batches "$(IFS=,; echo "${DECODE_BATCHES[*]}")" --context "$CONTEXT"
                --prefill-tokens "$PREFILL" --steps 8)
    SERVE_ARGS=(--max-num-seqs 256 --max-model-len 4096 --max-num-batched-tokens 8192
                --max-prefill-tokens-while-decoding 2048)
    LEVELS=("1 8" "256 512")  # concurrency, requests: each level well under two minutes
    MAX_TOKENS=256
    unset TRITON_INTERPRET  # the real kernels
else
    # A tiny shape of the same architecture, so that every step runs here in seconds.
    MODEL="$OUT_DIR/tiny/config.json"
    mkdir -p "$OUT_DIR/tiny"
    cat > "$MODEL" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 10000.0}
EOF
    MODEL_ARGS=(--batches 1,4 --context 32 --prefill-tokens 64 --steps 2)
    SERVE_ARGS=(--max-num-seqs 8 --kv-cache-memory 4MiB --threads 1)
    LEVELS=("1 2" "4 8")
    MAX_TOKENS=8
    export TRITON_INTERPRET=1
fi

# Run a step: its command in the log (or on stdout with --dry-run), its seconds in timings.json.
declare -A SECONDS_OF
step() {
    local name="$1"
    shift
    if [ "$DRY_RUN" = 1 ]; then
        echo "[$name] $*"
        return 0
    fi
    echo "[$name] $*" | tee "$OUT_DIR/logs/$name.log" >&2
    local started=$SECONDS status=0
    "$@" >> "$OUT_DIR/logs/$name.log" 2>&1 || status=$?
    SECONDS_OF[$name]=$((SECONDS - started))
    echo "[$name] exit $status after ${SECONDS_OF[$name]} s" >&2
    return "$status"
}

if compgen -G ".whl/*.whl" > /dev/null; then
    step install "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" .whl/*.whl
    export PYTHONPATH="$ROOT:$SITE"
else
    echo "gpu_check: no wheels in .whl/: using the packages $PY has" >&2
    export PYTHONPATH="$ROOT"
fi

SERVER_PID=""
stop_server() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2> /dev/null; then
        kill -TERM "$SERVER_PID"
        for _ in $(seq 1 90); do
            kill -0 "$SERVER_PID" 2> /dev/null || break
            sleep 1
        done
        kill -0 "$SERVER_PID" 2> /dev/null && kill -KILL "$SERVER_PID"
        wait "$SERVER_PID" 2> /dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT

# 1. Every test marked cuda (they skip without a device), from the files that have any.
mapfile -t CUDA_TESTS < <(grep -rl --include='test_*.py' 'pytest.mark.cuda' tests | sort)
step tests "$PY" -m pytest -q -p no:cacheprovider -m cuda --junitxml="$OUT_DIR/pytest.xml" \
    "${CUDA_TESTS[@]}" || true

# 2. The model runner alone: prefill, and decode as CUDA graphs against eager steps.
step model "$PY" -m perf.cli model --device "$DEVICE" --random-weights "$MODEL" --weights bf16 \
    "${MODEL_ARGS[@]}" --json "$OUT_DIR/model.json" || true

# 2b. What each measured decode step should take on this GPU (pipeline-bench roofline: the bytes
# and FLOPs of every kernel by design, at the GPU's HBM bandwidth and tensor peak), which the
# report sets beside the measured step. On CPU there is no GPU to predict.
if [ "$DEVICE" = cuda ]; then
    if [ "$DRY_RUN" = 1 ]; then
        GPU_KIND="${GPU_KIND:-h200}"
    else
        GPU_KIND="${GPU_KIND:-$("$PY" -c 'import torch
name = torch.cuda.get_device_name().lower()
print(next((k for k in ("h200", "h100", "a100") if k in name), ""))' || true)}"
    fi
    if [ -z "$GPU_KIND" ]; then
        echo "gpu_check: no roofline for this GPU (the roofline knows a100, h100, h200)" >&2
    else
        for batch in "${DECODE_BATCHES[@]}"; do
            step "roofline_b$batch" "$PY" -m perf.cli roofline --model "$MODEL" --gpu "$GPU_KIND" \
                --batch "$batch" --context "$CONTEXT" --max-model-len "$PREFILL" \
                --json "$OUT_DIR/roofline_b$batch.json" || true
        done
    fi
fi

# 3. The server on the same shape, and the load generator at each level.
PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
URL="http://127.0.0.1:$PORT"
if [ "$DRY_RUN" = 1 ]; then
    echo "[serve] $PY -m server.cli --random-weights $MODEL --device $DEVICE --port $PORT ${SERVE_ARGS[*]}"
else
    echo "[serve] starting pipeline-serve on $URL" >&2
    "$PY" -m server.cli --random-weights "$MODEL" --device "$DEVICE" --port "$PORT" \
        --log-format json "${SERVE_ARGS[@]}" > "$OUT_DIR/logs/serve.log" 2>&1 &
    SERVER_PID=$!
    started=$SECONDS
    "$PY" - "$URL" "$SERVER_PID" <<'EOF'
import os, sys, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("gpu_check: the server exited while starting (see logs/serve.log)")
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            if response.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit("gpu_check: the server was not ready within 300 s")
EOF
    SECONDS_OF[serve_start]=$((SECONDS - started))
fi
for level in "${LEVELS[@]}"; do
    read -r concurrency requests <<< "$level"
    step "serve_c$concurrency" "$PY" -m perf.cli serve --url "$URL" \
        --concurrency "$concurrency" --num-requests "$requests" --prompt-tokens 256 \
        --max-tokens "$MAX_TOKENS" --json "$OUT_DIR/serve_c$concurrency.json" || true
done
stop_server

if [ "$DRY_RUN" = 1 ]; then
    echo "[report] $PY -m perf.gpu_report $OUT_DIR"
    exit 0
fi
{
    echo "{"
    first=1
    for name in "${!SECONDS_OF[@]}"; do
        [ $first = 1 ] || echo ","
        printf '  "%s": %s' "$name" "${SECONDS_OF[$name]}"
        first=0
    done
    echo "}"
} > "$OUT_DIR/timings.json"
"$PY" -m perf.gpu_report "$OUT_DIR"
