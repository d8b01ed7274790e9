#!/usr/bin/env bash
# Tensor parallelism on a multi-GPU machine (nvidia-h200-x2; x4 adds the TP = 4 rows).
# Phases in $PHASES (default "tests enginecheck engine"; each fits one 10-minute device call):
#   tests       gpu-marked TP tests (NCCL batch-sharded sampling, TP2 dummy models, the TP2
#               engine on tiny llama / qwen3 against TP1 with CUDA graphs)
#   enginecheck the serving engine at TP 2 is correct: float32 dummy qwen3-0.6b, TP 2 greedy
#               and seeded tokens == TP 1 (CUDA graphs with captured all-reduces, NCCL)
#   engine      the serving engine, llama-3.1-8b (W3 shape) TP 1 vs TP 2 at batch 1 and 256
#   engine32b   qwen3-32b dummy served at TP 2 (batch 1 and 64)
#   engine70b   llama-3.1-70b dummy served at TP 2 (141 GB of bf16 weights: more than one H200)
#   sampling    batch-sharded vs all-gathered sampling: peak logits memory per rank, time
#   w3          static-batch model loop (no engine): llama-3.1-8b TP 1 vs TP 2 at batch 1, 256
#   32b / 70b   static-batch model loop at TP 2
#   usage (device tool, carry .whl):  PHASES="enginecheck engine" TANDEM_COMMIT=<sha> bash benchmarks/gpu_tp.sh
# Results land in $OUT as JSON, with a short table per phase in $OUT/tp.log.
set -u
. benchmarks/device_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONFAULTHANDLER=1
LOG="$OUT/tp.log"
PHASES=${PHASES:-"tests enginecheck engine"}
phase() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

phase "devices"
nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>&1 | tee -a "$LOG"
nvidia-smi topo -m 2>&1 | tee -a "$LOG"
for p in $PHASES; do
  case $p in
    tests)
      phase "pytest TP"
      timeout -s ABRT 300 python3 -m pytest -q -p no:cacheprovider --tb=short \
        tests/gpu/test_tensor_parallel.py tests/gpu/test_tp_launch.py tests/gpu/test_tp_engine.py \
        -k "nccl or tp_launch or cuda" \
        2>&1 | tail -30 | tee -a "$LOG" ;;
    enginecheck)
      phase "engine: TP 2 tokens == TP 1 tokens"
      timeout -s ABRT 580 python3 benchmarks/bench_tp_engine.py --tp 2 --check-only \
        --out "$OUT/tp_engine_check.json" 2>&1 | tail -25 | tee -a "$LOG" ;;
    engine)
      phase "engine: W3 shape, TP 1 vs TP 2"
      timeout -s ABRT 580 python3 benchmarks/bench_tp_engine.py --tp 1,2 --batch 1,256 \
        --no-check --out "$OUT/tp_engine_w3.json" 2>&1 | tail -25 | tee -a "$LOG" ;;
    engine32b)
      phase "engine: qwen3-32b served at TP 2"
      timeout -s ABRT 580 python3 benchmarks/bench_tp_engine.py --model dummy:qwen3-32b --tp 2 \
        --batch 1,64 --no-check --out "$OUT/tp_engine_32b.json" 2>&1 | tail -20 | tee -a "$LOG" ;;
    engine70b)
      phase "engine: llama-3.1-70b served at TP 2"
      timeout -s ABRT 580 python3 benchmarks/bench_tp_engine.py --model dummy:llama-3.1-70b \
        --tp 2 --batch 1,64 --input-len 128 --output-len 256 --no-check \
        --out "$OUT/tp_engine_70b.json" 2>&1 | tail -20 | tee -a "$LOG" ;;
    sampling)
      phase "batch-sharded vs all-gathered sampling"
      timeout -s ABRT 420 python3 benchmarks/bench_tp_sampling.py --tp 2,4 \
        --out "$OUT/tp_sampling.json" 2>&1 | tail -40 | tee -a "$LOG" ;;
    w3)
      phase "W3 shape, TP 1 vs TP 2"
      timeout -s ABRT 560 python3 benchmarks/bench_tp_model.py --preset llama-3.1-8b --tp 1,2 \
        --batch 1,256 --out "$OUT/tp_model_w3.json" 2>&1 | tail -20 | tee -a "$LOG" ;;
    32b)
      phase "qwen3-32b at TP 2"
      timeout -s ABRT 560 python3 benchmarks/bench_tp_model.py --preset qwen3-32b --tp 2 \
        --batch 1,64 --no-check --out "$OUT/tp_model_32b.json" 2>&1 | tail -20 | tee -a "$LOG" ;;
    70b)
      phase "llama-3.1-70b at TP 2"
      timeout -s ABRT 560 python3 benchmarks/bench_tp_model.py --preset llama-3.1-70b --tp 2 \
        --batch 1,64 --no-check --out "$OUT/tp_model_70b.json" 2>&1 | tail -20 | tee -a "$LOG" ;;
  esac
done
phase "done"
