#!/usr/bin/env bash
# One call on the GPU machine: build the extension, run the GPU tests, run the kernel benchmark.
#
# Usage (repo root):
#   benchmarks/run_device.sh [all|build-test|bench|tune|image|head-and-errors|head-sweep|topk|head|
#                             gluon-topk|gdn|attention|tree|tree-hybrid]
# (default all)
# Logs go to $OUT (or ./out when OUT is unset): env.txt, build.log, tests.log, bench.log,
# bench.md, bench.json, sanitize.log, tune.log, suite.log, probe.log.
#
# "image" installs as the Dockerfile does (docker/install.sh, megatron-core from the wheels in
# .whl: carry it), runs docker/smoke.py, the GPU tests, the CPU suites of the gather, head and
# model on this machine's torch, the probe example on one GPU (NCCL, CP 1) and the tuning sweep.
#
# "head-and-errors" (no extension build: the row ops fall back to torch, which is exact) runs the
# head's GPU tests (CUDA vs CPU, one rank and TP 2 x CP 2 over gloo), the bad-input matrix on
# CUDA tensors over gloo, the exchange's per-call cost (bench_exchange.py, NCCL and gloo), and
# the head benchmark (bench_head.py; liger-kernel and cut-cross-entropy wheels from .whl: carry
# it). Logs: head_tests.log, no_hang.log, exchange_nccl.log, exchange_gloo.log, head_bench.*.
set -uo pipefail

mode="${1:-all}"
case "$mode" in
  all | build-test | bench | tune | image | head-and-errors | head-sweep | topk | head | gluon-topk | gdn | attention | tree | tree-hybrid) ;;
  *) echo "unknown mode: $mode" >&2; exit 2 ;;
esac

out="${OUT:-$PWD/out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
# The GPU machines set CXX=/opt/gcc/bin/g++, which links the C++ runtime statically: a failing
# TORCH_CHECK then segfaults instead of raising, so setup.py refuses that build (naming this
# fix). The system compiler links libstdc++.so and the checks raise RuntimeError.
if [[ -x /usr/bin/g++ && -x /usr/bin/gcc ]]; then
  export CXX=/usr/bin/g++ CC=/usr/bin/gcc
fi

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
  nvcc --version | tail -n 1
} 2>&1 | tee "$out/env.txt"

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# Installs the pure-Python wheels carried in .whl (peers, pytest-xdist) beside the repository.
carry_wheels() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
}

# The head's GPU tests, in 8 processes when pytest-xdist is carried in .whl (Triton compiles
# dominate their time); call after carry_wheels.
head_gpu_tests() {
  local xdist=()
  "$py" -c "import xdist" 2>/dev/null && xdist=(-n 8)
  echo "== head GPU tests"
  timeout "${TESTS_TIMEOUT:-300}" "$py" -m pytest tests/head/test_vocab_ops_cuda.py \
    tests/head/test_output_cuda.py -q -rs "${xdist[@]}" -p no:cacheprovider 2>&1 \
    | tee "$out/vocab_tests.log" | tail -n 6
}

if [[ "$mode" == head || "$mode" == topk ]]; then
  # head: the head table (bench_head.py, peers from .whl; BENCH_METHODS narrows it); topk: the
  # top-k configs side by side on both shapes. Each then runs the head's GPU tests, or first with
  # TESTS_FIRST=1 (new kernels: their results before their timings).
  carry_wheels
  if [[ "${TESTS_FIRST:-0}" == 1 ]]; then
    head_gpu_tests
  fi
  if [[ "$mode" == head ]]; then
    echo "== head benchmark"
    timeout "${BENCH_TIMEOUT:-240}" "$py" benchmarks/head/bench_head.py --reps "${BENCH_REPS:-3}" \
      --warmup 1 ${BENCH_METHODS:+--methods "$BENCH_METHODS"} --out "$out" 2>&1 \
      | tee "$out/head_bench.log" | tail -n 40
  fi
  case "$mode" in
    topk)
      echo "== top-k sweep"
      timeout "${SWEEP_TIMEOUT:-240}" "$py" benchmarks/head/bench_head.py --sweep --sweep-only \
        --sweep-kernels fwd_topk --reps 6 --out "$out" 2>&1 | tee "$out/topk_sweep.log" \
        | tail -n 30
      ;;
  esac
  if [[ "${TESTS_FIRST:-0}" != 1 ]]; then
    head_gpu_tests
  fi
  exit 0
fi

if [[ "$mode" == gluon-topk ]]; then
  # The Gluon top-k forward: the head's GPU tests first (its side-by-side with the Triton kernel
  # and the fp64 "triton-topk" cases among them), then both top-k kernels alone per split count
  # and both calls (probe_pingpong.py --topk-splits), then the head table with every method and
  # both top-k paths. Timeouts sum to 580 s: one device call (600 s).
  carry_wheels
  TESTS_TIMEOUT="${TESTS_TIMEOUT:-220}" head_gpu_tests
  echo "== top-k kernels per split count, Gluon and Triton"
  timeout "${PROBE_TIMEOUT:-100}" "$py" benchmarks/probes/probe_pingpong.py --topk-splits \
    --reps "${PROBE_REPS:-7}" 2>&1 | tee "$out/probe_topk_splits.log" | grep -E "^\||Error" \
    | tail -n 50
  echo "== head benchmark"
  methods=ours,ours+top20,ours+top20/triton,ours@1024,cublas-floor,naive,liger,cce
  timeout "${BENCH_TIMEOUT:-260}" "$py" benchmarks/head/bench_head.py --reps "${BENCH_REPS:-9}" \
    --warmup 1 --methods "${BENCH_METHODS:-$methods}" --out "$out" 2>&1 \
    | tee "$out/head_bench.log" | tail -n 45
  exit 0
fi

if [[ "$mode" == attention ]]; then
  # The fused attention: the extension (row gathers), the GPU tests of the plans and the tree
  # tables against the float64 oracle, the tree attention rows (bench_tree.py, no model), then
  # bench_attention.py with BENCH_ARGS (default: the named plans at both sizes, both layouts and
  # the larger-group blocked variants beside the choice), and the tables' host time on this
  # machine (probe_table_host.py --named). ~500 s. nvidia-cudnn-frontend and pytest-xdist from
  # .whl: carry it. Logs: build.log, attention_tests.log, tree/, bench_attention.*, table_host.log.
  carry_wheels
  echo "== build"
  { time MCP_FORCE_CUDA_BUILD=1 "$py" setup.py build_ext --inplace; } >"$out/build.log" 2>&1
  tail -n 3 "$out/build.log"
  xdist=()
  "$py" -c "import xdist" 2>/dev/null && xdist=(-n 8)
  echo "== attention GPU tests"
  timeout -s INT "${TESTS_TIMEOUT:-150}" "$py" -m pytest tests/attention/test_fused_cuda.py \
    tests/attention/test_tree_tables_cuda.py -q -rf "${xdist[@]}" -p no:cacheprovider 2>&1 \
    | tee "$out/attention_tests.log" | tail -n 8
  echo "== tree attention"
  timeout -s INT 75 "$py" benchmarks/models/bench_tree.py --no-model --no-hybrid --reps 3 \
    --out "$out/tree" 2>&1 | tee "$out/tree.log" | grep -E "^\||Error" | tail -n 8
  echo "== attention benchmark"
  # shellcheck disable=SC2086 # BENCH_ARGS is a list of options
  timeout -s INT "${BENCH_TIMEOUT:-300}" "$py" benchmarks/attention/bench_attention.py \
    ${BENCH_ARGS:---named --no-flex --no-graph-builds --compare-layouts --block-variants --reps 3} \
    --out "$out" 2>&1 | tee "$out/bench_attention.log" | grep -E "^\||Error" | tail -n 30
  echo "== tables on this host"
  timeout -s INT 60 "$py" benchmarks/probes/probe_table_host.py --named --reps 10 2>&1 \
    | tee "$out/table_host.log" | grep -E "^\||Error" | tail -n 20
  exit 0
fi

if [[ "$mode" == tree ]]; then
  # Tree packing: the extension, each tree GPU test file on its own (names and tracebacks kept:
  # -v, and SIGINT at the time limit so pytest still prints its summary), then bench_tree.py
  # (TREE_BENCH_ARGS, default --reps 3). fla's gated backward is lifted past its Triton guard
  # for the GDN tests and rows. Carry .whl. Logs: build.log, tree_tests_*.log, bench_tree.*.
  carry_wheels
  export MCP_LIFT_FLA_HOPPER_GUARD=1
  echo "== build"
  { time MCP_FORCE_CUDA_BUILD=1 "$py" setup.py build_ext --inplace; } >"$out/build.log" 2>&1
  tail -n 3 "$out/build.log"
  for t in attention/test_tree_tables_cuda models/test_tree_forward_cuda mixers/test_gdn_tree_cuda; do
    echo "== $t"
    timeout -s INT "${TESTS_TIMEOUT:-150}" "$py" -m pytest "tests/$t.py" -v -rf --tb=short \
      -p no:cacheprovider 2>&1 | tee "$out/tree_tests_${t##*/}.log" | grep -E "PASS|FAIL|ERROR|Error" | tail -n 20
  done
  echo "== tree benchmark"
  # shellcheck disable=SC2086 # TREE_BENCH_ARGS is a list of options
  timeout -s INT "${BENCH_TIMEOUT:-300}" "$py" benchmarks/models/bench_tree.py \
    --lift-fla-hopper-guard ${TREE_BENCH_ARGS:---reps 3} --out "$out" 2>&1 \
    | tee "$out/bench_tree.log" | grep -v -i warn | tail -n 30
  exit 0
fi

if [[ "$mode" == tree-hybrid ]]; then
  # The tree benchmark's GDN hybrid rows alone (the GDN layer, then the whole step; fla compiles
  # its tree variants on first use, which took the rows past 190-230 s in calls that also ran
  # other sections). TREE_HYBRID_ARGS default: the first GRPO batch, pattern G-*-, 2 rounds.
  # The extension first (~35 s): without it the row ops fall back to torch, slower.
  carry_wheels
  echo "== build"
  { time MCP_FORCE_CUDA_BUILD=1 "$py" setup.py build_ext --inplace; } >"$out/build.log" 2>&1
  tail -n 3 "$out/build.log"
  echo "== tree benchmark, GDN hybrid rows"
  # shellcheck disable=SC2086 # TREE_HYBRID_ARGS is a list of options
  timeout -s INT "${BENCH_TIMEOUT:-540}" "$py" benchmarks/models/bench_tree.py \
    --lift-fla-hopper-guard --attention skip --no-model \
    ${TREE_HYBRID_ARGS:---batches 4096+8x1024 --hybrid-pattern G-*- --reps 2} --out "$out" 2>&1 \
    | tee "$out/bench_tree_hybrid.log" | grep -v -i warn | tail -n 30
  exit 0
fi

if [[ "$mode" == gdn ]]; then
  # Gated DeltaNet on fla's kernels (issue 28): the GPU test (the layer at CP 1 and CP 2 over
  # gloo on one GPU, bf16, against the plain-torch reference), then bench_gdn.py (S = 20,436,
  # Qwen3.5-27B's GDN shape, one rank). Needs fla-core 0.6.0 and einops (pure-Python wheels)
  # beside megatron-core: carry them in .whl. Logs: gdn_tests.log, gdn_bench.log.
  # MCP_LIFT_FLA_HOPPER_GUARD=1 and GDN_BENCH_ARGS=--lift-fla-hopper-guard run fla's gated
  # backward where it refuses Triton < 3.7.1 on Hopper (see bench_gdn.py).
  carry_wheels
  echo "== GDN GPU tests"
  timeout "${TESTS_TIMEOUT:-240}" "$py" -m pytest tests/mixers/test_gdn_cuda.py -q -rs \
    -p no:cacheprovider 2>&1 | tee "$out/gdn_tests.log" | tail -n 15
  echo "== GDN benchmark"
  # shellcheck disable=SC2086 # GDN_BENCH_ARGS is a list of options
  timeout "${BENCH_TIMEOUT:-300}" "$py" benchmarks/mixers/bench_gdn.py ${GDN_BENCH_ARGS:-} 2>&1 \
    | tee "$out/gdn_bench.log" | tail -n 16
  exit 0
fi

if [[ "$mode" == head-sweep ]]; then
  # The bad-input matrix on CUDA tensors (issue 11), the head kernels' schedule sweep on a full
  # vocabulary and a TP-4 shard, then the head's GPU tests (every schedule variant).
  echo "== bad-input matrix, CPU and CUDA tensors over gloo"
  timeout 150 "$py" -m pytest tests/comm/test_no_hang.py -q -rs -p no:cacheprovider 2>&1 \
    | tee "$out/no_hang.log" | tail -n 8
  echo "== head schedule sweep"
  timeout 330 "$py" benchmarks/head/bench_head.py --sweep --sweep-only --reps 4 --out "$out" 2>&1 \
    | tee "$out/head_sweep.log" | tail -n 60
  echo "== head GPU tests"
  timeout 200 "$py" -m pytest tests/head/test_vocab_ops_cuda.py -q -x -rs -p no:cacheprovider 2>&1 \
    | tee "$out/vocab_tests.log" | tail -n 15
  exit 0
fi

if [[ "$mode" == head-and-errors ]]; then
  carry_wheels
  echo "== head GPU tests"
  timeout 150 "$py" -m pytest tests/head/test_output_cuda.py -q -rs -p no:cacheprovider 2>&1 \
    | tee "$out/head_tests.log" | tail -n 15
  echo "== bad-input matrix, CPU and CUDA tensors over gloo"
  timeout 150 "$py" -m pytest tests/comm/test_no_hang.py -q -rs -p no:cacheprovider 2>&1 \
    | tee "$out/no_hang.log" | tail -n 8
  echo "== exchange cost"
  timeout 90 "$py" benchmarks/comm/bench_exchange.py --backend nccl --device cuda 2>&1 \
    | tee "$out/exchange_nccl.log" | tail -n 8
  timeout 120 "$py" benchmarks/comm/bench_exchange.py --backend gloo --device cuda --world 2 \
    --reps 100 2>&1 | tee "$out/exchange_gloo.log" | tail -n 9
  echo "== head benchmark"
  timeout 150 "$py" benchmarks/head/bench_head.py --reps 3 --warmup 1 --out "$out" 2>&1 \
    | tee "$out/head_bench.log" | tail -n 40
  exit 0
fi

if [[ "$mode" == image ]]; then
  echo "== docker/install.sh --editable --wheel-dir .whl --require-cuda"
  start=$SECONDS
  bash docker/install.sh --editable --wheel-dir .whl --require-cuda >"$out/build.log" 2>&1 \
    || { tail -n 60 "$out/build.log"; exit 1; }
  grep -iE "build summary|CUDA extension|unchanged|installed" "$out/build.log" | head -n 20
  echo "install: $((SECONDS - start)) s"
  echo "== docker/smoke.py --require-cuda"
  (cd /tmp && "$py" "$OLDPWD/docker/smoke.py" --require-cuda --expect-megatron-core 0.19.2) \
    2>&1 | tail -n 15
  export MCP_REQUIRE_EXTENSION=1
  echo "== GPU tests"
  timeout 300 "$py" -m pytest tests/comm/test_row_ops_cuda.py tests/comm/test_row_ops.py -q -rs \
    -p no:cacheprovider 2>&1 | tee "$out/tests.log" | tail -n 5
  echo "== CPU suites on this torch (gather, head, model)"
  # No GPU for them: megatron-core would put rotary tables on cuda:0 beside a CPU model.
  CUDA_VISIBLE_DEVICES= timeout 300 "$py" -m pytest tests/comm/test_plan.py tests/comm/test_mappings.py \
    tests/head/test_output.py tests/models/test_forward.py tests/models/test_report_regression.py -q -p no:cacheprovider 2>&1 \
    | tee "$out/suite.log" | tail -n 5
  echo "== probe example on one GPU (NCCL, CP 1)"
  timeout 200 "$py" examples/cp_probe.py --device cuda --cp-sizes 1 --world-size 1 2>&1 \
    | tee "$out/probe.log" | tail -n 12
  mode=tune
fi

if [[ "$mode" != tune ]]; then
echo "== build (pip install --no-build-isolation --no-deps -e .)"
start=$SECONDS
if ! MCP_FORCE_CUDA_BUILD=1 timeout 420 "$py" -m pip install -v --no-build-isolation --no-deps -e . \
    >"$out/build.log" 2>&1; then
  echo "pip editable build failed; trying setup.py build_ext --inplace" | tee -a "$out/build.log"
  MCP_FORCE_CUDA_BUILD=1 timeout 420 "$py" setup.py build_ext --inplace >>"$out/build.log" 2>&1 \
    || { tail -n 60 "$out/build.log"; exit 1; }
fi
grep -E "build summary|CUDA extension|TORCH_CUDA_ARCH_LIST|registers|spill" "$out/build.log" | head -n 20
echo "build: $((SECONDS - start)) s"
fi
export MCP_REQUIRE_EXTENSION=1
"$py" -c 'import megatron.context_parallel.comm.row_ops
from megatron.context_parallel import _extension
print("extension:", _extension.status())' || exit 1

if [[ "$mode" != bench && "$mode" != tune ]]; then
  echo "== tests"
  start=$SECONDS
  timeout 300 "$py" -m pytest tests/comm/test_row_ops_cuda.py tests/comm/test_row_ops.py -q -rs -p no:cacheprovider \
    2>&1 | tee "$out/tests.log" | tail -n 40
  echo "tests: $((SECONDS - start)) s"
fi

if [[ "$mode" == all ]] && command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer memcheck on small odd cases"
  cat >/tmp/mcp_sanitize.py <<'PY'
import torch
from megatron.context_parallel.comm import row_ops as ops
g = torch.Generator().manual_seed(0)
for slots, widths, lead in ((7, [48, 6, 2, 1], 1), (33, [10240, 160, 80, 4], 0), (0, [8], 0)):
    W = lead + sum(widths) + 3
    packed = torch.randint(0, 256, (slots, W), generator=g, dtype=torch.uint8).cuda()
    idx = torch.randint(-1, max(slots, 1), (50,), generator=g).clamp(max=slots - 1).cuda()
    offs = [lead + sum(widths[:f]) for f in range(len(widths))]
    ops.scatter_rows(packed, idx, offs, widths)
    ops.gather_rows(packed[:, 1:], idx)
torch.cuda.synchronize()
print("SANITIZE-DONE")
PY
  timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 "$py" /tmp/mcp_sanitize.py \
    >"$out/sanitize.log" 2>&1; echo "memcheck rc=$?"; tail -n 4 "$out/sanitize.log"
fi

if [[ "$mode" != build-test && "$mode" != tune ]]; then
  echo "== benchmark"
  start=$SECONDS
  timeout 300 "$py" benchmarks/comm/bench_kernels.py --json "$out/bench.json" --markdown "$out/bench.md" \
    2>&1 | tee "$out/bench.log" | tail -n 60
  echo "bench: $((SECONDS - start)) s"
fi

if [[ "$mode" == all || "$mode" == tune ]]; then
  echo "== tuning: most threads per row (hidden states CP 4 and logits, kernel only)"
  for t in 32 64 128 256; do
    echo "-- --max-threads-per-row $t"
    timeout 120 "$py" benchmarks/comm/bench_kernels.py --quick --with-logits --ours-only --reps 200 \
      --max-threads-per-row "$t" 2>&1 | grep scatter_rows
  done 2>&1 | tee "$out/tune.log"
fi
