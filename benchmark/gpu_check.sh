#!/usr/bin/env bash
# The prepared device check of the GPU path: under 7.5 minutes on one H200, a compact summary at the end.
#
#   (a) tests on CUDA: the Triton kernels against the references (real shapes, bf16; attention, LoRA,
#       fused MoE, MLA), tiny MoE / MLA models on the Triton kernels against HF, the triton
#       attention backend against torch_native, greedy outputs identical across backends and with
#       CUDA graphs on and off, in process and through the Engine (overlap scheduler), float32 and
#       bf16, on the default model (or its shape with random weights, see below); --quantization fp8
#       (torch._scaled_mm) against bf16, a GGUF file dequantized at load on CUDA, and the Triton
#       kernels and backend reading int8 / fp8_e4m3 / fp8_e5m2 KV caches in place (--kv-cache-dtype);
#   (b) a Llama-3.1-8B-shaped model (--load-format dummy, bf16) through the Engine: batch-1 decode
#       tokens/s against the HBM ceiling (4.8 TB/s / bytes of weights a step reads), and output
#       throughput at 64 and 256 concurrent requests (random 256-token prompts, 256 new tokens).
#
# Which Python: one whose torch has CUDA. The project's .venv holds the CPU build of torch and does
# not work there. On this workplace's H200 machines use the plain `python3` (Python 3.12 with a CUDA
# torch and triton); set PYTHON=... for another. It installs nothing from the network: the packages
# that python lacks (pyzmq, orjson, fastapi, uvicorn, pydantic, xgrammar, gguf, ...) come as wheels
# in .whl/, installed into a temp dir. The default model's package (94 MB) is too large to travel, so
# its config and tokenizer come in .gpu_check/ and the tests use its shape with random weights.
#
#   bash benchmark/gpu_check.sh prepare   # here, with the .venv and network: fills .whl/ and .gpu_check/
#   bash benchmark/gpu_check.sh           # on the device machine, carrying .whl and .gpu_check
#
# Results go to $GPU_CHECK_OUT (default /tmp/gpu_check/out): each stage's log, pytest.log, bench.json
# and summary.txt, the summary, printed last also when a stage fails or times out; where $OUT is set
# (the device tool), the summary, pytest.log, bench.json and a tarball of all logs are copied there.
# Each stage has a timeout and all of them share a budget of $GPU_CHECK_BUDGET seconds (420).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD

WHEELS="pyzmq orjson fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions
opentelemetry-api uvicorn xgrammar apache-tvm-ffi gguf requests urllib3 idna certifi charset-normalizer"

prepare() {
  local py=${VENV_PYTHON:-.venv/bin/python}
  "$py" benchmark/gpu_check.py prepare || exit 1
  local specs
  specs=$("$py" -c "import importlib.metadata as m, sys; print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" \
    $WHEELS) || exit 1
  mkdir -p .whl
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $specs || exit 1
  du -sh .whl .gpu_check
  echo "now run on the device machine: bash benchmark/gpu_check.sh   (carry .whl and .gpu_check)"
}

if [ "${1:-}" = prepare ]; then
  prepare
  exit 0
fi

PY=${PYTHON:-python3}
export GPU_CHECK_WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
RES=${GPU_CHECK_OUT:-$GPU_CHECK_WORK/out}
export RADIXSERVE_CACHE_DIR=$GPU_CHECK_WORK/cache PYTHONUNBUFFERED=1
mkdir -p "$RES" "$GPU_CHECK_WORK"
: > "$RES/stages.txt"
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET:-420}))

summary() {
  [ -f "$GPU_CHECK_WORK/test_model.json" ] && cp "$GPU_CHECK_WORK/test_model.json" "$RES/"
  { "$PY" benchmark/gpu_check.py summary "$RES" 2>/dev/null || python3 benchmark/gpu_check.py summary "$RES" \
    || cat "$RES/stages.txt"; } | tee "$RES/summary.txt"
  if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then  # the device tool returns at most 8 files from $OUT
    cp "$RES/summary.txt" "$OUT/"
    for f in pytest.log bench.json; do [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/"; done
    tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$RES" .
  fi
}
trap summary EXIT

# stage NAME SECONDS CMD...: runs CMD with its output in $RES/NAME.log, within the shared budget.
stage() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS - 5))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    echo "$name: skipped (budget spent)" >> "$RES/stages.txt"
    return 1
  fi
  local start=$SECONDS rc
  timeout -k 10 "$limit" "$@" > "$RES/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "$name: ok ($((SECONDS - start)) s)" >> "$RES/stages.txt"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "$name: timed out after $limit s (see $name.log)" >> "$RES/stages.txt"
  else
    echo "$name: failed with exit $rc (see $name.log): $(tail -n 1 "$RES/$name.log")" >> "$RES/stages.txt"
  fi
  return $rc
}

CHECK_CUDA='
import sys
import torch
ok = torch.cuda.is_available()
print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, CUDA "
      + (f"{torch.version.cuda}, {torch.cuda.get_device_name(0)}" if ok else "unavailable"))
if not ok:
    print("this python has no CUDA torch: run with PYTHON=/path/to/a/python/with/CUDA/torch "
          "(the project .venv has the CPU build of torch)")
sys.exit(0 if ok else 3)
'

if ! stage env 30 "$PY" -c "$CHECK_CUDA"; then
  cat "$RES/env.log"
  exit 2
fi
head -n 1 "$RES/env.log" > "$RES/env.txt"

if ls .whl/*.whl > /dev/null 2>&1; then
  stage deps 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$GPU_CHECK_WORK/site" .whl/*.whl || exit 1
  export PYTHONPATH=$GPU_CHECK_WORK/site:$ROOT
else
  echo "deps: no .whl/ (run prepare here first); using the installed packages" >> "$RES/stages.txt"
  export PYTHONPATH=$ROOT
fi
stage imports 30 "$PY" -c "import zmq, orjson, fastapi, uvicorn, xgrammar, gguf, triton, srt.entrypoints.engine" \
  || exit 1

FAILED=0
if stage test_model 45 "$PY" benchmark/gpu_check.py test-model; then
  export RADIXSERVE_TEST_MODEL=$(tail -n 1 "$RES/test_model.log")
else
  FAILED=1
fi
# (a) GPU tests: most telling first, so a timeout keeps them; -v records each result as it ends
RADIXSERVE_INSTAFAIL=1 stage pytest 230 "$PY" -m pytest -v -p no:cacheprovider -o addopts="" -m "not slow and not soak" -rfE --timeout 120 \
  tests/model_executor/test_cuda_graph_runner.py tests/layers/test_triton_backend.py \
  tests/kernels/test_triton_kernels.py tests/layers/test_gpu_ops.py tests/model_executor/test_kv_pool_sizing.py \
  tests/model_loader/test_dummy_load.py tests/model_loader/test_gpu_quantization.py \
  tests/kernels/test_triton_moe_mla.py tests/kernels/test_triton_lora.py \
  "tests/models/test_moe_mla.py::test_every_kernel_gives_hf_tokens[triton-triton]" \
  tests/models/test_moe_mla.py::test_greedy_matches_hf_with_any_batching_chunking_and_paging \
  || FAILED=1
# (b) Llama-3.1-8B shape, dummy weights, bf16
stage bench 180 "$PY" benchmark/gpu_check.py bench "$RES/bench.json" || FAILED=1
exit $FAILED
