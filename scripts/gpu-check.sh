#!/usr/bin/env bash
# The GPU checks of dtrain, as one prepared script: what a session lent a GPU machine runs (issue 46).
#
#   scripts/gpu-check.sh [STAGE ...]      stages: install tests suite probe spread bench (default: install tests bench)
#
# Run from the repository's root on the GPU machine; results go under $OUT (default /tmp/gpu-check-out):
#   env.txt        nvidia-smi, python, torch, the installed wheels
#   test_gpu.txt   tests/test_gpu.py (every test marked gpu) and tests/test_cuda_hidden.py, with CUDA visible
#   suite.txt      the files that failed where CUDA was visible (fixtures of every scope must see none)
#   probe.txt      bench/gpu_probe.py: a GPU step timed alone, in chains and in a long loop, per precision
#   spread.txt     bench/gpu_spread.py: rounds of fresh processes (plain bf16 loop, free and on one core; dtrain
#   spread.json    fp32 and the doctor's --try precision; dtrain bf16-mixed, 16-mixed, tf32) for SPREAD_SECONDS
#                  (330): how far a host-bound step moves between processes, and the doctor against that
#   bench.txt      bench/gpu.py: plain loop vs dtrain run in fp32, tf32, bf16, fp16 (GradScaler) and bf16
#   bench.json     without a data path (a batch kept on the device): steady state and first steps, MFU,
#                  and the aten operations and CUDA kernels of one bf16 step on each side; and what
#                  `dtrain doctor --try precision=...` predicted from the fp32 run against the measured gains,
#                  and `--try hyperparameters.global_batch_size=2B` of the fp32 and bf16-mixed runs against
#                  those precisions run again at twice the batch
#
# Sizes, measured on an H100 on 2026-11-27: install 10-13 s; `install bench` (one round, 5 steps profiled)
# 222 s; tests 232 s; the suite stage did not finish in the about 180 s left of a 430 s call. The machine's
# start counts too (about 40 s then), and a 15-minute budget held two calls: `install bench`, then `install
# tests` (add `suite` only with more than 3 minutes to spare beyond those). On an H200 on 2026-11-27, with the
# twice-the-batch runs: `install bench tests` (BENCH_ONLY=fp32,tf32,bf16,fp16 BENCH_OPS=0) took 526 s in one
# call (install 15 s, bench 248 s, tests 256 s), about 558 s of the budget with the start; `bench` again at
# once on the warm machine, 248 s (265 s of budget). On an H200 on 2026-11-27 at 19:58: `install spread`
# (SPREAD_SECONDS=320) 262 s with 2 rounds of 123-140 s each (297 s of budget with the start), then at once
# `tests spread` (255) 354 s: tests 205 s (14 passed, 6 skipped for 2 GPUs), one round; the machine then went
# back with 239 s left. SPREAD_ARGS=--pinned runs every process of the spread on one core.
#
# Carry the wheels the machine's image lacks (it has torch, lightning, rich, matplotlib, pyyaml, numpy,
# scikit-learn, tensorboard, typer, pytest, pytest-timeout, pytest-xdist; see
# ../shared/notes/gpu-h100-facts.md) in .whl/ (git-ignored; name ".whl" in the run's carry), as cp312
# manylinux x86_64 wheels, one version each:
#   pydantic 2.14.3, pydantic-core 2.50.4, annotated-types, typing-inspection, typing-extensions>=4.16,
#   optuna 5.0.0, alembic, sqlalchemy, colorlog, Mako
# fetched here with (see /work/.library/device/README.md):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pydantic==2.14.3 pydantic-core==2.50.4 annotated-types typing-inspection \
#     'typing-extensions>=4.16' optuna==5.0.0 alembic sqlalchemy colorlog Mako
# Knobs: PYTHON (python3), WHEELS (.whl), OUT, BENCH_ROUNDS (1), BENCH_STEPS (200), BENCH_WARMUP (30),
# BENCH_OPS (5: bf16 steps profiled op by op; 0: none), BENCH_ONLY (the plain loops, and the dtrain rows held
# against them; e.g. BENCH_ONLY=fp32,tf32,bf16,fp16 BENCH_OPS=0: one round took 152-168 s of bench and
# 165-179 s with the install in three calls of 2026-11-27, on an H100 and an H200).
set -uo pipefail

PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(install tests bench)
status=0

install() {
    {
        nvidia-smi || true
        nvidia-smi topo -m || true
        lscpu || true
        "$PYTHON" --version
        "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
        if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
            "$PYTHON" -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl
            ls "$WHEELS"
        else
            echo "no wheels in $WHEELS: pydantic and optuna must already be importable"
        fi
        "$PYTHON" -m pip install -q --no-deps --no-build-isolation .
        "$PYTHON" -c 'import dtrain, pydantic, optuna; print("dtrain", dtrain.__file__, "pydantic", pydantic.VERSION)'
    } >"$OUT/env.txt" 2>&1 || { echo "install failed: see $OUT/env.txt"; tail -20 "$OUT/env.txt"; exit 1; }
}

tests() {
    # One GPU: the tests run one at a time (their timings would disturb each other side by side).
    "$PYTHON" -m pytest -q -p no:cacheprovider -ra --timeout 600 tests/test_gpu.py tests/test_cuda_hidden.py \
        2>&1 | tee "$OUT/test_gpu.txt" || status=1
}

suite() {
    # The files whose module fixtures errored at setup where CUDA was visible (issue 46), and the one that
    # failed beside them; every test here must see no CUDA.
    "$PYTHON" -m pytest -q -p no:cacheprovider -ra -n 8 -m "not timing" tests/config/test_fuzz.py \
        tests/engine/test_untrusted_checkpoint.py tests/explain/test_verify.py tests/engine/test_step_ops.py \
        tests/sync/test_single.py 2>&1 | tee "$OUT/suite.txt" || status=1
}

probe() {
    # How a GPU step must be timed to predict a run's step (issue 45): one step, chains, a long loop.
    "$PYTHON" bench/gpu_probe.py --rounds "${PROBE_ROUNDS:-2}" --json "$OUT/probe.json" 2>&1 \
        | tee "$OUT/probe.txt" || status=1
}

spread() {
    # Why the doctor's host-bound precision predictions miss both ways (issue 45): the host, process to process?
    "$PYTHON" bench/gpu_spread.py --seconds "${SPREAD_SECONDS:-330}" ${SPREAD_ARGS:-} --json "$OUT/spread.json" 2>&1 \
        | tee "$OUT/spread.txt" || status=1
}

bench() {
    "$PYTHON" bench/gpu.py --rounds "${BENCH_ROUNDS:-1}" --steps "${BENCH_STEPS:-200}" \
        --only "${BENCH_ONLY:-fp32,tf32,bf16,fp16,bf16-resident}" \
        --warmup "${BENCH_WARMUP:-30}" --ops "${BENCH_OPS:-5}" --json "$OUT/bench.json" 2>&1 \
        | tee "$OUT/bench.txt" || status=1
}

for stage in "${stages[@]}"; do
    case "$stage" in
        install | tests | suite | probe | spread | bench) echo "== $stage ($(date -u +%H:%M:%S))"; "$stage" ;;
        *) echo "unknown stage '$stage': use install, tests, suite, probe, spread or bench"; exit 2 ;;
    esac
done
echo "== done ($(date -u +%H:%M:%S)): results in $OUT"
exit $status
