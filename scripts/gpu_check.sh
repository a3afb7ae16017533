#!/usr/bin/env bash
# GPU checks and benchmarks of the CUDA data plane, in phases, each logged under $OUT:
#   bash scripts/gpu_check.sh info cuda bench suite
#   info : GPU, torch / fbgemm_gpu / torchrec versions                      -> $OUT/info.txt
#   cuda : the `cuda`-marked tests (tests/scenarios/test_cuda_parity.py)    -> $OUT/cuda_tests.log
#   bench: train.py step time (whole run; steady = the progress windows after the first) + FBGEMM HBM-cache hit
#          rate, herald vs stock TorchRec FUSED_UVM_CACHING with the same cache size, world size 1 (and 2 ranks
#          sharing the GPU over gloo)                                      -> $OUT/bench.json, $OUT/bench.log
#   suite: the regular test suite (not slow), distributed / parity files first -> $OUT/suite.log
# Needs python3 with torch (CUDA), fbgemm_gpu, torchrec, hydra importable (PYTHONPATH), cwd = the project root.
# A phase that fails is reported and the next one still runs; the exit status is the number of failed phases.
# DEADLINE (epoch seconds, optional): the suite phase is cut to end 10 s before it, so that a device call with a hard
# limit still brings back every log (the suite's log then ends where it was stopped).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
PY=${PY:-python3}
STEPS=${STEPS:-400}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
failed=0

info() {
  { nvidia-smi -L; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import sys, torch, fbgemm_gpu, torchrec; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| fbgemm_gpu', getattr(fbgemm_gpu, '__version__', '?'), '| torchrec', getattr(torchrec, '__version__', '?'),
'| cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    # the compiled kernels once, before pytest's workers and the ranks would each build them
    "$PY" -c "from herald_torchrec.schedule import native; from herald_torchrec.distributed import host_kernels as s
print('compiled kernels:', native.KERNELS.build(), s.KERNELS.build())"
  } 2>&1 | tee "$OUT/info.txt"
}

cuda() {
  timeout "${CUDA_TEST_S:-300}" "$PY" -m pytest -q -m cuda -p no:cacheprovider -rA tests/scenarios/test_cuda_parity.py 2>&1 \
    | tee "$OUT/cuda_tests.log"
}

# one train.py run: name, nproc, args...; its metrics.json is summarised into $OUT/bench.json by summarise()
one_run() {
  local name=$1 nproc=$2; shift 2
  local dir=/tmp/gpu_bench/$name
  rm -rf "$dir"
  local launch=("$PY" train.py)
  [ "$nproc" -gt 1 ] && launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc" train.py)
  echo "=== $name: ${launch[*]} $* run_dir=$dir" | tee -a "$OUT/bench.log"
  timeout "${RUN_S:-150}" "${launch[@]}" "$@" "trainer.steps=$STEPS" trainer.eval_interval=0 trainer.log_interval=100 \
    data.val_batches=1 "run_dir=$dir" >>"$OUT/bench.log" 2>&1
  local rc=$?
  tail -n 2 "$OUT/bench.log"
  echo "--- rc=$rc" >>"$OUT/bench.log"
  return $rc
}

bench() {
  rm -rf /tmp/gpu_bench; : >"$OUT/bench.log"
  local clf=${CLF:-0.2} ratio=0.1
  # Herald's TBE holds home + guest rows (1 + cache_ratio of the table at world size 1): scale its load factor so
  # both caches get the same number of lines (hbm_cache_lines in the results shows it)
  local hclf
  hclf=$("$PY" -c "print(round($clf / (1 + $ratio), 6))")
  local stock=(scheduler=torchrec +sharding.compute_kernel=fused_uvm_caching "+sharding.cache_load_factor=$clf")
  local herald=(scheduler=herald "scheduler.cache_ratio=$ratio" "+sharding.cache_load_factor=$hclf")
  local rc=0
  one_run dcn_torchrec_uvm 1 model=dcn "${stock[@]}" || rc=1
  one_run dcn_herald 1 model=dcn "${herald[@]}" || rc=1
  one_run wdl64_torchrec_uvm 1 model=wdl model.embedding_dim=64 "${stock[@]}" || rc=1
  one_run wdl64_herald 1 model=wdl model.embedding_dim=64 "${herald[@]}" || rc=1
  if [ "${BENCH_HBM:-1}" = 1 ]; then one_run dcn_torchrec_hbm 1 model=dcn scheduler=torchrec || rc=1; fi  # stock, tables in HBM
  # two ranks sharing the one GPU (gloo over CUDA tensors): not a real 2-GPU figure. Both get the same cache lines over
  # all ranks (Herald's TBEs hold 1 + R * ratio of the rows in all); metrics.json's hbm_cache_* are all-rank totals
  if [ "${BENCH_R2:-1}" = 1 ]; then
    local hclf2
    hclf2=$("$PY" -c "print(round($clf / 2 / (0.5 + $ratio), 6))")
    one_run dcn_torchrec_uvm_r2 2 model=dcn "${stock[@]}" || true
    one_run dcn_herald_r2 2 model=dcn scheduler=herald "scheduler.cache_ratio=$ratio" "+sharding.cache_load_factor=$hclf2" || true
  fi
  summarise
  return $rc
}

summarise() {
  "$PY" - "$OUT/bench.json" "$OUT/bench.log" <<'EOF'
import json, re, statistics, sys
from pathlib import Path
# steady state: the median of the progress lines' samples/s after the first window (which holds the warm-up)
windows = {}
for part in re.split(r"^=== ", Path(sys.argv[2]).read_text(), flags=re.M)[1:]:
    windows[part.split(":")[0]] = [float(m.group(1)) for m in
                                   re.finditer(r"^step\s+\d+\s+loss \S+\s+(\d+) samples/s", part, re.M)]
out = {}
for d in sorted(Path("/tmp/gpu_bench").glob("*")):
    f = d / "metrics.json"
    if not f.exists():
        out[d.name] = {"error": "no metrics.json (see bench.log)"}
        continue
    m = json.loads(f.read_text())
    sps = m.get("samples_per_s") or float("nan")
    keep = {k: m.get(k) for k in ("hbm_cache_hit_rate", "hbm_cache_lines", "hbm_cache_unique_ids",
                                   "hbm_cache_unique_misses", "auc", "steps", "world_size", "global_batch",
                                   "samples_per_s", "hit_rate", "comm_bytes_per_step", "embedding_kernels")}
    keep["step_ms"] = 1e3 * m["global_batch"] / sps if sps == sps and sps > 0 else None
    later = windows.get(d.name, [])[1:]
    keep["steady_step_ms"] = 1e3 * m["global_batch"] / statistics.median(later) if later else None
    out[d.name] = keep
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
print(json.dumps(out, indent=1))
EOF
}

suite() {
  local first=(tests/distributed/storage/test_row_store.py tests/distributed/test_embeddingbag.py
               tests/scenarios/test_module_parity.py tests/distributed/test_mixed.py)
  local rest par=()
  rest=$(find tests -name 'test_*.py' ! -name test_cuda_parity.py | sort | grep -v -x -F "$(printf '%s\n' "${first[@]}")")
  # pytest-xdist where the machine has it (the device image does): 4 workers ran the suite in 4 min 15 s on an H200 host
  "$PY" -c "import xdist" 2>/dev/null && par=(-n "${SUITE_WORKERS:-4}")
  "$PY" -c "import pytest_timeout" 2>/dev/null && par+=(--timeout 300)
  local limit=${SUITE_S:-540}
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - $(date +%s) - 10))
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -le 30 ] && { echo "suite: skipped, ${limit}s left before DEADLINE" | tee "$OUT/suite.log"; return 1; }
  fi
  echo "suite: ${limit}s at most"
  # -v: each test's outcome is logged as it ends (with workers, pytest's own summary only comes at the very end, and
  # a suite cut by the limit would name no failure); the terminal gets the failures and the totals
  timeout "$limit" "$PY" -m pytest -v -m "not slow and not cuda" -p no:cacheprovider -rfE \
    "${par[@]}" "${first[@]}" $rest >"$OUT/suite.log" 2>&1
  local rc=$?
  grep -E "(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/suite.log" | tail -n 40
  [ $rc -eq 124 ] && echo "suite: stopped at its limit (${limit}s); $(grep -cE ' PASSED ' "$OUT/suite.log") passed so far"
  return $rc
}

for phase in "${@:-info cuda bench suite}"; do
  for p in $phase; do
    echo "##### phase $p ($(date -u +%H:%M:%S))"
    "$p" || { echo "##### phase $p FAILED"; failed=$((failed + 1)); }
  done
done
exit $failed
