#!/usr/bin/env bash
# One prepared run of every GPU-only check, for a session lent one NVIDIA H200
# for ~15 minutes in all (one machine start, one command). Run from the repo root:
#
#     bash scripts/gpu_check.sh              # results under $OUT (default runs/gpu)
#
# Steps (each under its own `timeout`; a failed step is reported and the next
# one still runs; the script exits 1 at the end if any failed):
#   0. pick a Python whose torch sees the GPU (see "Python" below);
#   1. nvidia-smi;
#   2. tests/model/test_staged_cuda.py: staged vs unsplit logits, KV-cached
#      decode and pipeline-backward gradients on cuda:0 (2 stages on cuda:0,cuda:0);
#   3. scripts/gpu_profile_torch.py: llama-1b, 2 stages on cuda:0, measured with
#      the executor's own code (services/executor/torch_measure.py), both latency
#      models fitted (profiler/fit.py) -> h200-llama-1b-2stage.json + fit report;
#   4. benchmarks/decode_throughput.py --model llama-1b --device cuda:0, batch 1/8/32,
#      each decode step against the HBM floor (weight bytes / 4.8 TB/s, H200).
# Budget: ~1 min start + <1 min tests + <=5 min profile + <=4 min benchmark,
# inside the device tool's 10-minute command limit (run it with timeout_s=600).
#
# Python. The checkout's .venv is a CPU build made on another machine (and too
# big to carry), so it is used only if it exists there AND its torch sees a GPU.
# Otherwise the device image's `python3` is used if its torch sees one (the
# H200 image ships a CUDA torch, transformers, numpy, grpcio, pytest). Only if
# neither does, a fresh venv gets a CUDA wheel of the .venv's torch version from
# $TORCH_INDEX_URL, bounded by a timeout (that machine may have no network, in
# which case this step fails fast and the script stops: nothing else can run).
#
# Packages the image may lack or have too old (structlog; protobuf >= 7.35.1 for
# lemix/_proto's stubs) are carried as wheels in .whl/ (git-ignored), made here:
#     .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation py --platform any -d .whl protobuf==7.36.2 structlog==26.1.0
# and installed into /tmp/site only if the imports fail. Device tool call:
#     run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Results (at most 8 files come back from $OUT): gpu_check.log, the profile and
# its report, the benchmark JSON. Copy the profile to profiles/measured/ here.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START_S=$SECONDS
FAILED=()

header() { echo; echo "=== [$((SECONDS - START_S)) s] $* ==="; }

# step NAME TIMEOUT_S CMD...: run CMD under a timeout; record a failure, go on.
step() {
    local name="$1" limit="$2"
    shift 2
    header "$name (timeout ${limit} s)"
    if timeout --kill-after=10 "$limit" "$@"; then
        echo "--- $name: ok ($((SECONDS - START_S)) s)"
    else
        local rc=$?
        echo "--- $name: FAILED rc=$rc$([ "$rc" -eq 124 ] && echo ' (timed out)')"
        FAILED+=("$name")
    fi
}

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1; }

header "0. python with a CUDA torch"
PY=""
if [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then
    PY=.venv/bin/python
elif command -v python3 >/dev/null && has_cuda python3; then
    PY=python3
else
    # Last resort: a fresh venv with the CUDA build of the .venv's torch version.
    TORCH_VERSION=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])' \
        2>/dev/null || echo "")
    TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}"
    echo "no CUDA torch found; installing torch==${TORCH_VERSION:-latest} from $TORCH_INDEX_URL"
    VENV=/tmp/lemix-cuda-venv
    timeout 60 python3 -m venv --system-site-packages "$VENV"
    timeout 420 "$VENV/bin/pip" install -q --index-url "$TORCH_INDEX_URL" \
        "torch${TORCH_VERSION:+==$TORCH_VERSION}"
    timeout 180 "$VENV/bin/pip" install -q -e .
    PY="$VENV/bin/python"
    has_cuda "$PY" || { echo "torch still sees no GPU; giving up"; exit 1; }
fi
echo "python: $PY"

IMPORTS='import transformers, numpy, pytest
import services.executor.torch_measure, services.executor.torch_setup, profiler.fit'
if ! "$PY" -c "$IMPORTS" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "missing packages; installing the carried wheels: $(ls .whl)"
        timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
    fi
    "$PY" -c "$IMPORTS" || { echo "imports still fail (see above); carry .whl"; exit 1; }
fi
"$PY" - <<'EOF'
import google.protobuf, torch, transformers
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), transformers "
      f"{transformers.__version__}, protobuf {google.protobuf.__version__}, "
      f"gpu {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
EOF

step "1. nvidia-smi" 30 nvidia-smi

# --noconftest: tests/conftest.py starts Redis (redis-py is not on the image)
# and these tests need none of it.
step "2. staged model on CUDA (tests/model/test_staged_cuda.py)" 240 \
    "$PY" -m pytest --noconftest -p no:cacheprovider -q -rs tests/model/test_staged_cuda.py

PROFILE="$OUT/h200-llama-1b-2stage.json"
step "3. profile llama-1b, 2 stages on cuda:0 (scripts/gpu_profile_torch.py)" 330 \
    "$PY" scripts/gpu_profile_torch.py --model llama-1b --device cuda:0 --num-stages 2 \
    --repeats 5 --out "$PROFILE" --report "$OUT/h200-llama-1b-2stage.report.json"
if [ -f "$PROFILE" ]; then
    mkdir -p profiles/measured
    cp "$PROFILE" profiles/measured/  # on this machine; bring $OUT's copy home
fi

step "4. decode throughput, llama-1b on cuda:0 (benchmarks/decode_throughput.py)" 240 \
    "$PY" benchmarks/decode_throughput.py --model llama-1b --device cuda:0 \
    --batch-sizes 1,8,32 --prompt-tokens 64 --new-tokens 64 --repeats 3 \
    --staggered-requests 0 --hbm-gbps 4800 \
    --json "$OUT/decode_throughput_llama-1b.json"

header "done in $((SECONDS - START_S)) s; files in $OUT:"
ls -la "$OUT"
if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "FAILED steps: ${FAILED[*]}"
    exit 1
fi
echo "all steps passed"
