#!/usr/bin/env bash
# The GPU floor in one run on a machine with CUDA, in at most 6 minutes; one table at the end.
#
#   bash benchmarks/gpu_check.sh                           # the default reduction backend
#   HOOKCLI_REDUCTION=triton bash benchmarks/gpu_check.sh  # a backend by name, where this checkout has it
#
# 1. the CUDA tests: tests/test_cuda.py, and the Triton and lean reductions' tests on the GPU
#    (tests/test_reduce_triton.py, tests/test_reduce_lean.py: compiled Triton, TRITON_INTERPRET=0), and
#    a caller's CUDA weights copied on a model's first run only (tests/test_weight_guard.py);
# 2. the GPU rows of benchmarks/bench.py (--quick): stats on resnet50 b32 and on a ~1.1B-parameter
#    GPT-2-style model in bfloat16 (b1 s1024) against their bare forwards, the .item()-hooks peer and
#    peak device memory of each (section gpu); a watch's logged and unlogged step on the watch rows'
#    GPT-style model and on an 8-layer width-1024 b16 s256 one, the .item()-hooks peer and peak memory
#    (section watch_gpu);
# 3. torch.profiler's kernel launches per logged and unlogged step against a bare step
#    (benchmarks/launch_count.py), with the default backend and with HOOKCLI_REDUCTION=triton where the
#    checkout's reduction backend knows that name.
# Each part has its own time limit; a part that fails or runs out of time says so in the table.
# Without CUDA it prints "skipped: no CUDA" and exits 0.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "skipped: no CUDA"
    exit 0
fi
export TRITON_INTERPRET=0
OUT=$(mktemp -d "${TMPDIR:-/tmp}/hookcli-gpu-check-XXXXXX")

# Whether the reduction backend of this checkout knows a name (engine/backends.py's BACKENDS).
knows() {
    "$PY" -c "import sys
try:
    from hookcli.engine.backends import BACKENDS
except ImportError:
    sys.exit(1)
sys.exit(0 if sys.argv[1] in BACKENDS else 1)" "$1" 2>/dev/null
}
if [ -n "${HOOKCLI_REDUCTION:-}" ] && ! knows "$HOOKCLI_REDUCTION"; then
    echo "HOOKCLI_REDUCTION=$HOOKCLI_REDUCTION: this checkout's reduction backend has no such name; using its default"
    unset HOOKCLI_REDUCTION
fi

PARTS=()
# run NAME SECONDS COMMAND...: one part under its own time limit, its output in $OUT/NAME.log
run() {
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (at most ${limit} s)"
    start=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    local result="passed"
    [ "$rc" -eq 124 ] && result="TIMED OUT"
    [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && result="FAILED (exit $rc)"
    PARTS+=("$name|$result|$(( $(date +%s) - start ))")
}

run cuda-tests 140 "$PY" -m pytest -x -q -p no:cacheprovider tests/test_cuda.py tests/test_reduce_triton.py \
    tests/test_reduce_lean.py tests/test_weight_guard.py
run gpu-rows 140 "$PY" benchmarks/bench.py --quick --only gpu --only watch_gpu --json "$OUT/rows.json"
run launches 30 "$PY" benchmarks/launch_count.py --json "$OUT/launches-default.json"
if [ "${HOOKCLI_REDUCTION:-}" != "triton" ] && knows triton; then
    HOOKCLI_REDUCTION=triton run launches-triton 30 "$PY" benchmarks/launch_count.py \
        --json "$OUT/launches-triton.json"
fi

"$PY" - "$OUT" "${PARTS[@]}" <<'EOF'
import glob, json, os, sys

out, parts = sys.argv[1], sys.argv[2:]
print("\n" + "=" * 118)
print(f"{'part / target':<58} {'variant':<26} {'seconds':>9} {'ratio':>7}  goal")
for part in parts:
    name, result, seconds = part.split("|")
    print(f"{name:<58} {result:<26} {seconds:>9}")
rows_file = os.path.join(out, "rows.json")
if os.path.exists(rows_file):
    for r in json.load(open(rows_file)):
        if r.get("section") == "machine":
            continue
        seconds = f"{r['seconds']:.4f}" if r.get("seconds") is not None else ""
        ratio = f"{r['ratio']:.2f}" if r.get("ratio") is not None else ""
        met = {True: " met", False: " NOT MET"}.get(r.get("met"), "")
        print(f"{r['target'][:58]:<58} {r['variant'][:26]:<26} {seconds:>9} {ratio:>7}  {r.get('goal', '')}{met}")
for path in sorted(glob.glob(os.path.join(out, "launches-*.json"))):
    for r in json.load(open(path)):
        label = f"launches per step, {r['model']} ({r['reduction']})"
        print(f"{label[:58]:<58} {r['variant']:<26} {r['launches']:>9} {r['ratio']:>7.2f}  ({r['kernels']} kernels)")
print(f"logs: {out}")
EOF
