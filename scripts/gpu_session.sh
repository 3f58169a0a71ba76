#!/usr/bin/env bash
# One device call of the H200 session (see docs/performance.md). Usage: bash scripts/gpu_session.sh STAGE
#   stage 1 (carry .gpu-vllm/vllm.tar.xz .gpu-vllm/install.sh .whl/core): lay vLLM, run the kernel GPU tests and
#           the digest benchmark;
#   stage 2 (carry .gpu-vllm/extra .gpu-vllm/install.sh .whl): finish vLLM, run the GPU end-to-end tests,
#           the demo on CUDA and the refit overhead benchmark.
#   two-GPU machine (nvidia-h200-x2), three back-to-back calls:
#   stage x2a (carry as stage 1): lay vLLM, the NCCL broadcast / sharded-digest tests (no vLLM needed);
#   stage x2b (carry as stage 2): finish vLLM, the vLLM two-GPU tests (TP=2 colocated, native nccl, our
#           broadcast inside vLLM workers when X2B_MORE=tests/e2e/test_broadcast_path.py) and bench_refit --tp 2;
#   stage x2c (carry as stage 2): the one-GPU suite again, then bench_refit with TP=1.
#   one-GPU session of the model-boundary work, three back-to-back calls:
#   stage k (carry .gpu-vllm/vllm.tar.xz .gpu-vllm/install.sh and the msgspec wheel under .whl/core): lay vLLM,
#           compiled kernel tests, bench_digest, bench_engine_state (engine-state digest vs D2H + SHA-256);
#   stage t (carry .gpu-vllm/extra .gpu-vllm/install.sh): finish vLLM, the GPU suite (tests/gpu, CUDA transport
#           tests, the model boundary in an in-process CUDA engine, e2e), the demo on CUDA;
#   stage p (no carry; the machine of stage t, still warm): benchmarks/bench_paths.py, every path off vs enforce
#           (BENCH_ARGS: more options, e.g. --control or --paths ...; ROUNDS, BENCH_TIMEOUT); WITH_INLOOP=1: then
#           benchmarks/bench_inloop.py (per-call host cost inside a refit). Stage p alone takes about 330 s of a 600 s call (20 rounds):
#           run it in a call of its own, not after tests.
#   stage q (carry as stage t): bench_paths with --profile (cProfile of every child and mp worker process), 4 rounds.
#   stage s (carry as stage t, or none on stage t's still-warm machine): bench_paths at several sizes in one call
#           (S_SIZES, default qwen3-0.6b-like,qwen3-1.7b-like,qwen3-4b-like; S_PATHS, default transport,native-packed;
#           ROUNDS, default 12; the A/A control on; --budget-s S_BUDGET, default 500, skips a size that would end past it).
#           Each size's memory plan and the time estimate are printed first; each size's report is in $OUT as soon as it ends.
#   stage v (carry as stage t): stage t's suite plus the layout-map, FP8 and selftest modules, printing their figures.
#   stage u (carry as stage t): selected GPU tests only (U_TESTS, U_TIMEOUT), when device time is short.
#   stage w (carry as stage t): one call when device time is short: the demo, stage t's suite with the fused
#           copy+digest and derived-view kernel tests (W_TIMEOUT), bench_paths at W_SIZES (default 1.7B and 4B,
#           W_BUDGET), bench_fused_copy and bench_close_pass (4B-like).
#   stage f (carry as stage t): the first refit on CUDA: the demo, F_PROF (a profiling script, if given), F_TESTS (default
#           tests/gpu), bench_first_refit --device cuda (F_SETTINGS, ROUNDS; F_PROFILE=1: --profile, the refit splits and
#           a cProfile of the trainer's send, first refit minus third; F_PROFILE_ROUNDS=N: that profile from N more rounds of
#           setting 3 after the timed ones, which then stay unprofiled; F_TIMERS=1: --timers, per-function timers of both
#           processes, refit by refit; F_TESTS=none, F_DEMO=0: skip those; keep the demo on a fresh machine: it fills the
#           Triton and vLLM caches, without it the bench's first engine starts in about 2 minutes, not 45 s).
#   stage d (carry as stage t): the direct-launch and kept-set GPU tests, bench_host_ops (JIT vs direct launches), then
#           bench_paths as stage p (ROUNDS, BENCH_ARGS, BENCH_TIMEOUT).
#   stage b (carry as stage k; replaces it when the kernels did not change): lay vLLM, the toy-model boundary tests on
#           CUDA and benchmarks/bench_boundary.py.
# Everything is logged under $OUT.
set -uo pipefail
stage=${1:?stage}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
bash .gpu-vllm/install.sh >"$OUT/install-$stage.log" 2>&1; tail -3 "$OUT/install-$stage.log"
[ "$stage" = 0 ] && exit 0
[ -f .gpu-vllm/env.sh ] && . .gpu-vllm/env.sh
# wheels this image may lack (our dependencies, pytest, rich); carried in .whl/core and .whl/ui
for w in .whl/*/*.whl; do
  m=$(basename "$w" | cut -d- -f1); m=${m/markdown_it_py/markdown_it}; m=${m/pyzmq/zmq}
  python3 -c "import $m" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile "$w" 2>&1 | tail -1
done
# refit-verify itself, with its entry point (vLLM finds the plugin through it)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip-$stage.log" 2>&1 || tail -5 "$OUT/pip-$stage.log"
python3 - <<'PY'
import torch, triton, importlib.metadata as md
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), "|",
      [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "refit_verify"])
PY
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
if [ "$stage" = b ]; then  # first call of a boundary-only session (carry as stage k): no vLLM needed beyond the install
  timeout 200 python3 -m pytest -n 0 -q -m "gpu or not gpu" tests/boundary/test_model.py tests/digest/test_backends.py tests/digest/test_batch.py \
    -p no:cacheprovider >"$OUT/boundary-tests.log" 2>&1; echo "boundary tests rc=$?"; grep -E "passed|failed|^E |^FAILED" "$OUT/boundary-tests.log" | head -12
  timeout 200 python3 benchmarks/bench_boundary.py --rounds 20 --out "$OUT/bench_boundary.md" >"$OUT/bench_boundary.log" 2>&1
  echo "bench_boundary rc=$?"; tail -8 "$OUT/bench_boundary.md" 2>/dev/null || tail -20 "$OUT/bench_boundary.log"
elif [ "$stage" = k ]; then
  timeout 240 python3 -m pytest -n 0 -q -m "gpu or not gpu" tests/digest/kernels tests/digest/test_batch.py tests/digest/test_reference_vectors.py tests/digest/test_backends.py \
    tests/collective/test_sharded.py -x -p no:cacheprovider >"$OUT/kernel-tests.log" 2>&1; echo "kernel tests rc=$?"; tail -4 "$OUT/kernel-tests.log"
  echo "kernel tests: $(( $(date +%s) - t0 )) s"
  timeout 150 python3 benchmarks/bench_digest.py --out "$OUT/bench_digest.md" >"$OUT/bench_digest.log" 2>&1; echo "bench_digest rc=$?"
  tail -22 "$OUT/bench_digest.md" 2>/dev/null
  timeout 120 python3 benchmarks/bench_engine_state.py --rounds 20 --out "$OUT/bench_engine_state.md" 2>&1 | tail -8
elif [ "$stage" = t ]; then
  timeout 170 refit-verify demo >"$OUT/demo-cuda.log" 2>&1; echo "demo rc=$?"; grep -E "verified|caught|proven|PASS|FAIL|Error" "$OUT/demo-cuda.log" | head -12
  timeout 380 python3 -m pytest -n 0 -q -m "gpu or not gpu" tests/gpu tests/transport/test_transport.py tests/e2e/test_boundary.py \
    tests/boundary/test_model.py tests/boundary/test_plan.py tests/digest/test_kept.py tests/e2e/test_replicas_and_canary.py tests/digest/test_batch.py tests/digest/test_backends.py --ignore tests/gpu/test_two_gpu.py --ignore tests/gpu/test_native_nccl_two_gpu.py \
    -p no:cacheprovider >"$OUT/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"
  grep -E "passed|failed|^E |^FAILED|^ERROR" "$OUT/gpu-tests.log" | head -24; echo "gpu tests: $(( $(date +%s) - t0 )) s"
elif [ "$stage" = v ]; then  # stage t's suite plus the layout map, FP8 and selftest modules, with their printed figures (carry as stage t)
  timeout 150 refit-verify demo >"$OUT/demo-cuda.log" 2>&1; echo "demo rc=$?"; grep -E "verified|caught|proven|PASS|FAIL|Error" "$OUT/demo-cuda.log" | head -12
  # in-process engines keep their GPU memory in the pytest process: the layout-map and FP8 modules run in one of their own
  timeout ${V_TIMEOUT:-420} python3 -m pytest -n 0 -q -s -m "gpu or not gpu" tests/gpu tests/transport/test_transport.py tests/e2e/test_boundary.py \
    tests/e2e/test_selftest.py tests/boundary/test_model.py tests/boundary/test_plan.py tests/digest/test_kept.py tests/digest/test_batch.py \
    tests/digest/test_backends.py --ignore tests/gpu/test_two_gpu.py --ignore tests/gpu/test_native_nccl_two_gpu.py \
    --ignore tests/gpu/test_fp8_gpu.py --ignore tests/gpu/test_layout_map_gpu.py \
    -p no:cacheprovider --durations=12 >"$OUT/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"
  timeout 200 python3 -m pytest -n 0 -q -s -m "gpu or not gpu" tests/gpu/test_fp8_gpu.py tests/gpu/test_layout_map_gpu.py \
    -p no:cacheprovider >"$OUT/gpu-tests-2.log" 2>&1; echo "gpu tests (fp8, layout map) rc=$?"
  cat "$OUT/gpu-tests-2.log" >>"$OUT/gpu-tests.log"
  grep -E "passed|failed|^E |^FAILED|^ERROR|^\[layout map|fp8|FP8|model runner|s call|s setup" "$OUT/gpu-tests.log" | grep -v " INFO " | head -60
  echo "gpu tests: $(( $(date +%s) - t0 )) s"
elif [ "$stage" = u ]; then  # selected GPU tests only (carry as stage t): U_TESTS (files / -k), U_TIMEOUT seconds
  timeout ${U_TIMEOUT:-240} python3 -m pytest -n 0 -q -m "gpu or not gpu" ${U_TESTS:?U_TESTS} -p no:cacheprovider --durations=8 >"$OUT/gpu-tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "passed|failed|^E |^FAILED|^ERROR|s call|s setup" "$OUT/gpu-tests.log" | head -30; echo "gpu tests: $(( $(date +%s) - t0 )) s"
elif [ "$stage" = w ]; then  # short-budget session (carry as stage t): demo, suite, sizes, kernel benches
  timeout 150 refit-verify demo >"$OUT/demo-cuda.log" 2>&1; echo "demo rc=$?"; grep -E "verified|caught|proven|PASS|FAIL|Error|first verified|own work" "$OUT/demo-cuda.log" | head -12
  timeout ${W_TIMEOUT:-240} python3 -m pytest -n 0 -q -m "gpu or not gpu" tests/gpu tests/transport/test_transport.py tests/e2e/test_boundary.py \
    tests/digest/kernels/test_launch_copy.py tests/digest/test_kept.py tests/digest/test_batch.py tests/boundary/test_close_reads.py \
    --ignore tests/gpu/test_two_gpu.py --ignore tests/gpu/test_native_nccl_two_gpu.py --ignore tests/gpu/test_fp8_gpu.py \
    --ignore tests/gpu/test_layout_map_gpu.py -p no:cacheprovider --durations=8 >"$OUT/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"
  grep -E "passed|failed|^E |^FAILED|^ERROR" "$OUT/gpu-tests.log" | head -24; echo "gpu tests: $(( $(date +%s) - t0 )) s"
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1
  timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/bench_paths.py --sizes ${W_SIZES:-qwen3-1.7b-like,qwen3-4b-like} \
    --paths transport,native-packed --rounds ${ROUNDS:-12} --budget-s ${W_BUDGET:-220} --pin --out "$OUT/bench_paths_sizes.md" >"$OUT/bench_paths_sizes.log" 2>&1
  echo "bench_paths sizes rc=$?"; grep -E "^# Refit|^\| (transport|native)" "$OUT/bench_paths_sizes.md" 2>/dev/null || tail -20 "$OUT/bench_paths_sizes.log"
  timeout 60 python3 benchmarks/bench_fused_copy.py --device cuda --rounds 7 --out "$OUT/bench_fused_copy.md" >"$OUT/bench_fused_copy.log" 2>&1
  echo "bench_fused_copy rc=$?"; tail -8 "$OUT/bench_fused_copy.md" 2>/dev/null || tail -12 "$OUT/bench_fused_copy.log"
  timeout 60 python3 benchmarks/bench_close_pass.py --model qwen3-4b-like --rounds 20 --out "$OUT/bench_close_pass.md" >"$OUT/bench_close_pass.log" 2>&1
  echo "bench_close_pass rc=$?"; tail -8 "$OUT/bench_close_pass.md" 2>/dev/null || tail -12 "$OUT/bench_close_pass.log"
  echo "stage w: $(( $(date +%s) - t0 )) s"
elif [ "$stage" = f ]; then  # the first refit on CUDA (carry as stage t): demo, a profile of the first refits, F_TESTS, bench_first_refit
  if [ "${F_DEMO:-1}" != 0 ]; then
    timeout 150 refit-verify demo >"$OUT/demo-cuda.log" 2>&1; echo "demo rc=$?"; grep -E "verified|caught|proven|PASS|FAIL|Error|first verified|own work" "$OUT/demo-cuda.log" | head -12
  fi
  [ -f "${F_PROF:-}" ] && { timeout 150 python3 "$F_PROF" cuda "$OUT/prof" >"$OUT/prof-first.log" 2>&1; echo "profile rc=$?"; grep -E "^REFIT" "$OUT/prof-first.log"; }
  if [ "${F_TESTS:-}" != none ]; then
    timeout ${U_TIMEOUT:-200} python3 -m pytest -n 0 -q -m "gpu or not gpu" ${F_TESTS:-tests/gpu} -p no:cacheprovider --durations=8 >"$OUT/gpu-tests.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "passed|failed|^E |^FAILED|^ERROR" "$OUT/gpu-tests.log" | head -24; echo "gpu tests: $(( $(date +%s) - t0 )) s"
  fi
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1
  timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_first_refit.py --device cuda --settings ${F_SETTINGS:-0,3} --rounds ${ROUNDS:-2} \
    --refits 4 ${F_PROFILE:+--profile "$OUT/first_refit_profile.txt"} ${F_TIMERS:+--timers "$OUT/first_refit_timers.txt"} \
    --out "$OUT/bench_first_refit.md" >"$OUT/bench_first_refit.log" 2>&1
  echo "bench_first_refit rc=$?"; grep -E "^\| " "$OUT/bench_first_refit.md" 2>/dev/null | head -12 || tail -20 "$OUT/bench_first_refit.log"
  [ -n "${F_TIMERS:-}" ] && head -${F_TIMERS_LINES:-45} "$OUT/first_refit_timers.txt"
  [ -n "${F_PROFILE:-}" ] && head -40 "$OUT/first_refit_profile.txt"
  if [ -n "${F_PROFILE_ROUNDS:-}" ]; then  # then a profiled run of setting 3 alone (the timed rounds above stay unprofiled)
    timeout ${F_PROFILE_TIMEOUT:-120} python3 benchmarks/bench_first_refit.py --device cuda --settings 3 --rounds "$F_PROFILE_ROUNDS" \
      --refits 4 --profile "$OUT/first_refit_profile.txt" --out "$OUT/bench_first_refit_profiled.md" >"$OUT/bench_first_refit_profiled.log" 2>&1
    echo "bench_first_refit (profiled) rc=$?"; head -34 "$OUT/first_refit_profile.txt"
  fi
  echo "stage f: $(( $(date +%s) - t0 )) s"
elif [ "$stage" = d ]; then
  timeout 150 python3 -m pytest -n 0 -q -m "gpu or not gpu" tests/gpu/test_direct_launch_gpu.py tests/gpu/test_graph_replay_gpu.py \
    tests/digest/test_kept.py tests/digest/kernels/test_direct.py -p no:cacheprovider >"$OUT/direct-tests.log" 2>&1
  echo "direct tests rc=$?"; grep -E "passed|failed|^E |^FAILED|^ERROR" "$OUT/direct-tests.log" | head -16
  timeout 90 python3 benchmarks/bench_host_ops.py --rounds 10 --out "$OUT/bench_host_ops.md" >"$OUT/bench_host_ops.log" 2>&1
  echo "bench_host_ops rc=$?"; tail -8 "$OUT/bench_host_ops.md" 2>/dev/null || tail -12 "$OUT/bench_host_ops.log"
  echo "stage d before bench_paths: $(( $(date +%s) - t0 )) s"
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1
  timeout ${BENCH_TIMEOUT:-380} python3 benchmarks/bench_paths.py --rounds ${ROUNDS:-20} ${BENCH_ARGS:-} --out "$OUT/bench_paths.md" >"$OUT/bench_paths.log" 2>&1
  echo "bench_paths rc=$?"; grep -A8 "^## Wall" "$OUT/bench_paths.md" 2>/dev/null || tail -30 "$OUT/bench_paths.log"
elif [ "$stage" = p ]; then
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1
  timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/bench_paths.py --rounds ${ROUNDS:-20} ${BENCH_ARGS:-} --out "$OUT/bench_paths.md" >"$OUT/bench_paths.log" 2>&1
  echo "bench_paths rc=$?"; grep -A8 "^## Wall" "$OUT/bench_paths.md" 2>/dev/null || tail -30 "$OUT/bench_paths.log"
  [ -n "${WITH_BOUNDARY:-}" ] && timeout 120 python3 benchmarks/bench_boundary.py --rounds 20 --out "$OUT/bench_boundary.md" >"$OUT/bench_boundary.log" 2>&1 \
    && tail -6 "$OUT/bench_boundary.md"
  if [ -n "${WITH_INLOOP:-}" ]; then
    timeout 240 python3 benchmarks/bench_inloop.py --rounds 20 --out "$OUT/bench_inloop.md" >"$OUT/bench_inloop.log" 2>&1
    echo "bench_inloop rc=$?"; tail -8 "$OUT/bench_inloop.md" 2>/dev/null || tail -20 "$OUT/bench_inloop.log"
  fi
  [ -n "${WITH_BOUNDARY:-}" ] && timeout 60 python3 benchmarks/bench_host_ops.py --rounds 5 --out "$OUT/bench_host_ops.md" \
    >"$OUT/bench_host_ops.log" 2>&1 && tail -12 "$OUT/bench_host_ops.md"
elif [ "$stage" = s ]; then  # several sizes in one invocation (see the header): tables in $OUT/bench_paths_sizes.md
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1
  timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/bench_paths.py --sizes ${S_SIZES:-qwen3-0.6b-like,qwen3-1.7b-like,qwen3-4b-like} \
    --paths ${S_PATHS:-transport,native-packed} --rounds ${ROUNDS:-12} --budget-s ${S_BUDGET:-500} --pin ${BENCH_ARGS:-} \
    --out "$OUT/bench_paths_sizes.md" >"$OUT/bench_paths_sizes.log" 2>&1
  echo "bench_paths sizes rc=$?"; grep -E "estimated|took|ready|did not start|floor:" "$OUT/bench_paths_sizes.log" | head -40
  grep -E -A8 "^# Refit|^## Wall" "$OUT/bench_paths_sizes.md" 2>/dev/null | grep -E "^# |^\| |memory plan|level|run took" || tail -30 "$OUT/bench_paths_sizes.log"
elif [ "$stage" = q ]; then  # profile (carry as stage t): where an enforce refit's host time goes, few rounds
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1
  timeout 500 python3 benchmarks/bench_paths.py --rounds ${ROUNDS:-4} --paths ${PATHS_Q:-transport,boundary-per-param,boundary-bucketed,native-packed} \
    --profile "$OUT/profile" --out "$OUT/bench_paths-profiled.md" >"$OUT/bench_paths-profiled.log" 2>&1
  echo "bench_paths --profile rc=$?"; ls -la "$OUT/profile"; grep -A12 "^## Wall" "$OUT/bench_paths-profiled.md" | head -14
elif [ "$stage" = x2a ]; then
  timeout 400 python3 -m pytest -n 0 -q -s -m "gpu or not gpu" tests/gpu/test_two_gpu.py -p no:cacheprovider >"$OUT/two-gpu.log" 2>&1
  grep -E "passed|failed|^E |^FAILED|^ERROR|^rank" "$OUT/two-gpu.log" | head -40; echo "two-gpu tests: $(( $(date +%s) - t0 )) s"
elif [ "$stage" = 1 ]; then
  timeout 200 python3 -m pytest -n 0 -q -m "gpu or not gpu" tests/digest/kernels tests/digest/test_batch.py tests/digest/test_reference_vectors.py -x -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/kernel-tests.log"
  echo "kernel tests: $(( $(date +%s) - t0 )) s"
  [ -f benchmarks/bench_variants.py ] && timeout 200 python3 benchmarks/bench_variants.py 2>&1 | tee "$OUT/bench_variants.txt" | tail -30
  timeout 200 python3 benchmarks/bench_digest.py --out "$OUT/bench_digest.md" 2>&1 | tail -25
elif [ "$stage" = 2 ]; then
  timeout 150 refit-verify demo >"$OUT/demo-cuda.log" 2>&1; rc=$?; echo "demo rc=$rc"
  grep -vE " INFO |FutureWarning" "$OUT/demo-cuda.log" | grep -E "Error|error|PASS|FAIL|│|verified|caught|read-back" | head -40
  if [ $rc != 0 ]; then  # diagnose: the first error lines of the engine, then a known-good GPU config
    grep -nE "Error|error|Traceback" "$OUT/demo-cuda.log" | head -30
    mkdir -p /tmp/gpu-llama && python3 -c "import json; c=json.load(open('src/refit_verify/data/tiny-llama/config.json')); c.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024); json.dump(c, open('/tmp/gpu-llama/config.json','w'))"
    timeout 150 refit-verify demo --model /tmp/gpu-llama >"$OUT/demo-cuda-256.log" 2>&1; echo "demo (hidden 256) rc=$?"
    grep -vE " INFO |FutureWarning" "$OUT/demo-cuda-256.log" | grep -E "Error|error|PASS|FAIL|│|verified|caught|read-back" | head -30
  fi
  timeout 330 python3 -m pytest -n 0 -q -m "gpu or not gpu" tests/gpu tests/transport/test_transport.py -p no:cacheprovider >"$OUT/gpu-tests.log" 2>&1
  grep -E "passed|failed|^E " "$OUT/gpu-tests.log" | head -20
  echo "gpu tests: $(( $(date +%s) - t0 )) s"
elif [ "$stage" = 4 ]; then  # end-to-end GPU tests, then the refit bench, in one call
  timeout 300 python3 -m pytest -n 0 -q -m "gpu or not gpu" tests/gpu tests/transport/test_transport.py -p no:cacheprovider >"$OUT/gpu-tests.log" 2>&1
  grep -E "passed|failed|^E |^FAILED|^ERROR" "$OUT/gpu-tests.log" | head -20
  echo "gpu tests: $(( $(date +%s) - t0 )) s"
  timeout 240 python3 benchmarks/bench_refit.py --refits 5 --out "$OUT/bench_refit.md" >"$OUT/bench_refit.log" 2>&1; echo "bench_refit rc=$?"
  grep -vE " INFO |WARNING" "$OUT/bench_refit.log" | tail -12
elif [ "$stage" = x2b ]; then
  for f in tests/e2e/test_tp2.py tests/gpu/test_native_nccl_two_gpu.py ${X2B_MORE:-}; do
    [ -f "$f" ] || continue; t1=$(date +%s); n=$(basename "$f" .py)
    timeout 190 python3 -m pytest -n 0 -q -s -m "gpu or not gpu" "$f" -p no:cacheprovider >"$OUT/$n.log" 2>&1
    echo "$n rc=$? $(( $(date +%s) - t1 )) s"; grep -E "passed|failed|skipped|^E |^FAILED|^ERROR" "$OUT/$n.log" | head -12
  done
  timeout 200 python3 benchmarks/bench_refit.py --tp 2 --refits ${REFITS:-10} --out "$OUT/bench_refit_tp2.md" >"$OUT/bench_refit_tp2.log" 2>&1; echo "bench_refit tp2 rc=$?"
  grep -vE " INFO |WARNING" "$OUT/bench_refit_tp2.log" | tail -9
elif [ "$stage" = x2c ]; then
  timeout 250 python3 -m pytest -n 0 -q -m "gpu or not gpu" tests/gpu tests/transport/test_transport.py \
    --ignore tests/gpu/test_two_gpu.py --ignore tests/gpu/test_native_nccl_two_gpu.py -p no:cacheprovider >"$OUT/gpu-tests.log" 2>&1
  grep -E "passed|failed|^E |^FAILED|^ERROR" "$OUT/gpu-tests.log" | head -20; echo "gpu tests: $(( $(date +%s) - t0 )) s"
  timeout 150 python3 benchmarks/bench_refit.py --refits ${REFITS:-10} --out "$OUT/bench_refit_tp1.md" >"$OUT/bench_refit_tp1.log" 2>&1; echo "bench_refit tp1 rc=$?"
  grep -vE " INFO |WARNING" "$OUT/bench_refit_tp1.log" | tail -9
elif [ "$stage" = x2d ]; then  # bench_refit --tp 2 only, per-refit lines
  timeout 200 python3 benchmarks/bench_refit.py --tp 2 --refits ${REFITS:-5} --out "$OUT/bench_refit_tp2.md" >"$OUT/bench_refit_tp2.log" 2>&1; echo "bench_refit tp2 rc=$?"
  grep -E "^(off|log|enforce):" "$OUT/bench_refit_tp2.log" | tail -16; grep -vE " INFO |WARNING" "$OUT/bench_refit_tp2.log" | tail -7
elif [ "$stage" = 3 ]; then
  timeout 60 python3 -m pytest -n 0 -q tests/digest/test_batch.py -p no:cacheprovider 2>&1 | tail -2
  timeout 400 python3 benchmarks/bench_refit.py --refits ${REFITS:-5} --out "$OUT/bench_refit.md" >"$OUT/bench_refit.log" 2>&1; echo "bench_refit rc=$?"
  grep -vE " INFO |WARNING" "$OUT/bench_refit.log" | tail -15
fi
echo "stage $stage done in $(( $(date +%s) - t0 )) s"
