#!/usr/bin/env bash
# Speed, one device call per part (nvidia-h200), from the project root; carried: .whl (../shared/tools/device-wheels.sh)
# and, for the flow parts, .data/cifar10 (a copy of ../shared/data/cifar10). Results under $OUT; each part is bounded
# by `timeout`. `bash benchmarks/throughput/gpu_speed.sh PART`, PART one of:
#
#   gpt                GPT 124M step vs nanoGPT (vendored model.py) and transformers GPT2 at micro-batch 16 (and 8, 32
#                      with BATCHES="8 16 32"; ~2 min each; VARIANTS=...: cuDNN attention, cut_cross_entropy, compiled
#                      optimizer, compile modes, float8 (bench_gpt_throughput.py's VARIANTS; LIMIT=s))
#   gpt-modern         the zh-poetry step, plain vs each modern option, AdamW vs Muon (bench_gpt_modern_speed.py;
#                      ROWS=arch/optimizer,...; ~4 min)
#   flow               seed pipeline vs --preset cifar10: steady-state img/s, cold/warm start-up, recompiles
#                      (benchmarks/throughput/gpu_flow_speed.sh; ~5 min)
#   lora               LoRA recompute off/full/selective on the Pythia-1.4B shape, seq 1024 x 4: s/step, FLOPs per pass,
#                      bytes kept, peak memory (~2 min)
#   qlora              the same for QLoRA (nf4 base; ~3 min)
#   lora-compiled      the LoRA rows with the blocks compiled (selective's policy applied at tracing, not per op; ~4 min)
#   lora-speed         LoRA / QLoRA tok/s, ours eager and compiled vs stock peft (no gradient checkpointing), Pythia-1.4B
#                      shape, seq 1024 x 4 x 2 (~4 min; ROWS=...; ROWS=lora-recompute-eager,lora-recompute-compiled:
#                      the low-memory rung)
#   lora-peers         the same on the TinyLlama-1.1B shape with Unsloth's rows (its own process; carry .whl-unsloth from
#                      benchmarks/tools/unsloth_wheels.sh; ~6 min)
#   flow-sampling      10,000 images at 20 evaluations: eager fp32/bf16, compiled, CUDA graphs
#                      (benchmarks/sampling/bench_flow_sampling.py)
#   flow-profile       torch.profiler of the flow UNet step (base 128, batch 256): convolution / group norm /
#                      elementwise / optimizer / gap shares (~2 min)
#   flow-variants      the isolated flow step under compile settings (VARIANTS=..., PROFILE=...: flow_step_variants.py):
#                      ms/step, device time by kernel (~1 min each)
#   graphs-accum       gradient accumulation under CUDA graphs vs the default compile, with and without the loop's
#                      before_graphed_micro_batch (graphs_accumulation_check.py)
#   flow-loop-profile  --preset cifar10's own loop under the profiler (benchmarks/tools/profile_recipe.py), reading the
#                      figures one step late and at once (SYNCS="0 1"; ~2 min)
#   gpt-profile        torch.profiler of the GPT 124M step at micro-batch 16 (and 8, 32 with BATCHES="8 16 32"): top
#                      kernels, attention/loss/optimizer/gap shares (benchmarks/tools/gpu_gpt_profile.py)
#   preset-profile     the same profiler on the zh-poetry and zh-poetry-modern presets' own steps (PRESETS="..."): where
#                      the modern step's extra time goes (~3 min)
set -u
PART=${1:-}
bash benchmarks/tools/gguf_parts.sh stash  # a carried part of the SmolLM2 GGUF waits in /tmp (gpu_finetune_smollm2.sh)
source benchmarks/gpu_env.sh --gpu || exit 1
OUT=${OUT:-/tmp/speed}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch,transformers,peft;print('torch',torch.__version__,'transformers',transformers.__version__,'peft',peft.__version__)"
} > "$OUT/env_$PART.txt" 2>&1
case "$PART" in
  flow) OUT=$OUT/flow bash benchmarks/throughput/gpu_flow_speed.sh ;;
  lora|qlora)
    timeout 400 python3 benchmarks/throughput/bench_lora_recompute.py --shape pythia-1.4b --tier "$PART" --seq 1024 --batch 4 \
      --warmup 3 --steps 10 --json "$OUT/${PART}_recompute.json" 2>&1 | tee "$OUT/${PART}_recompute.log" ;;
  gpt)
    # the cce / fp8 variants need cut_cross_entropy and torchao: carry .whl-unsloth (benchmarks/tools/unsloth_wheels.sh)
    ls .whl-unsloth/cut_cross_entropy-*.whl .whl-unsloth/torchao-*.whl > /dev/null 2>&1 && python3 -m pip install -q \
      --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-kernels .whl-unsloth/cut_cross_entropy-*.whl \
      .whl-unsloth/torchao-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site-kernels
    for B in ${BATCHES:-16}; do
      timeout ${LIMIT:-300} python3 benchmarks/throughput/bench_gpt_throughput.py --batch "$B" ${VARIANTS:+--variants $VARIANTS} \
        --json "$OUT/gpt_throughput_b$B.json" 2>&1 \
        | tee "$OUT/gpt_throughput_b$B.log"
    done ;;
  gpt-modern)
    timeout ${LIMIT:-220} python3 benchmarks/throughput/bench_gpt_modern_speed.py ${ROWS:+--rows $ROWS} \
      --json "$OUT/modern_speed.json" 2>&1 | tee "$OUT/modern_speed.log" ;;
  lora-speed)
    timeout ${LIMIT:-400} python3 benchmarks/throughput/bench_lora_speed.py ${ROWS:+--rows $ROWS} --json "$OUT/lora_speed.json" 2>&1 \
      | tee "$OUT/lora_speed.log" ;;
  lora-peers)
    # the Llama shape, ours vs stock peft in one process, then Unsloth in its own (it patches on import);
    # carry .whl-unsloth too (benchmarks/tools/unsloth_wheels.sh)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-unsloth \
      .whl-unsloth/*.whl || echo "no .whl-unsloth: the Unsloth rows will fail"
    timeout ${LIMIT:-300} python3 benchmarks/throughput/bench_lora_speed.py --shape tinyllama-1.1b \
      --rows ${ROWS:-lora-stock,lora-compiled,qlora-stock,qlora-compiled} --json "$OUT/peers.json" 2>&1 \
      | tee "$OUT/peers.log"
    PYTHONPATH=$PYTHONPATH:/tmp/site-unsloth HF_HUB_OFFLINE=1 timeout ${LIMIT:-240} python3 benchmarks/throughput/bench_lora_speed.py --shape tinyllama-1.1b \
      --rows unsloth-lora,unsloth-qlora --stock_json "$OUT/peers.json" --json "$OUT/unsloth.json" 2>&1 \
      | tee "$OUT/unsloth.log" ;;
  lora-compiled)
    # MODES="off,full,full+cpp,full+graphs": the C++ wrapper / CUDA graphs rows; EXTRA="--profile 2 --trace $OUT/tr":
    # device time by category and where the GPU waited for the host (benchmarks/tools/trace_gaps.py)
    timeout ${LIMIT:-400} python3 benchmarks/throughput/bench_lora_recompute.py --shape pythia-1.4b --tier lora --seq 1024 --batch 4 \
      --warmup 3 --steps 10 --compile true ${MODES:+--modes $MODES} ${EXTRA:-} \
      --json "$OUT/lora_compiled_recompute.json" 2>&1 \
      | tee "$OUT/lora_compiled_recompute.log" ;;
  flow-sampling)
    timeout 400 python3 benchmarks/sampling/bench_flow_sampling.py --json "$OUT/flow_sampling.json" 2>&1 \
      | tee "$OUT/flow_sampling.log" ;;
  flow-profile)
    # PROFILE_ARGS="--memory_format contiguous --launchers 6" TAG=name: another layout, who launched the top kernels
    timeout ${LIMIT:-300} python3 benchmarks/tools/gpu_gpt_profile.py --model flow ${PROFILE_ARGS:-} \
      --out "$OUT/flow_profile${TAG:+_$TAG}" 2>&1 | tee "$OUT/flow_profile${TAG:+_$TAG}.log" ;;
  flow-variants)
    timeout ${LIMIT:-540} python3 benchmarks/throughput/flow_step_variants.py ${VARIANTS:+--variants $VARIANTS} \
      ${PROFILE:+--profile $PROFILE} --json "$OUT/flow_variants${TAG:+_$TAG}.json" 2>&1 \
      | tee "$OUT/flow_variants${TAG:+_$TAG}.log" ;;
  graphs-accum)
    timeout ${LIMIT:-300} python3 benchmarks/throughput/graphs_accumulation_check.py --json "$OUT/graphs_accumulation.json" 2>&1 \
      | tee "$OUT/graphs_accumulation.log" ;;
  flow-loop-profile)
    for S in ${SYNCS:-0 1}; do
      HF_CGPU_SYNC_STEPS=$S timeout 300 python3 benchmarks/tools/profile_recipe.py --skip 60 --active 10 \
        --out "$OUT/flow_loop_sync$S" -- recipes/train_flow.py --preset cifar10 --dataset .data/cifar10 --max_steps 100 \
        --log_steps 25 --eval_steps 0 --sample_every_epochs 0 --checkpointing_steps 0 --progress false \
        --output_dir "/tmp/flow_loop_$S" ${EXTRA:-} 2>&1 | tail -60 | tee "$OUT/flow_loop_sync$S.log"
    done ;;
  gpt-profile)
    for B in ${BATCHES:-16}; do
      timeout 300 python3 benchmarks/tools/gpu_gpt_profile.py --batch "$B" --out "$OUT/gpt_profile_b$B" 2>&1 \
        | tee "$OUT/gpt_profile_b$B.log"
    done ;;
  preset-profile)
    for P in ${PRESETS:-zh-poetry zh-poetry-modern}; do
      timeout 240 python3 benchmarks/tools/gpu_gpt_profile.py --preset "$P" --steps 3 --out "$OUT/profile_$P" 2>&1 \
        | tee "$OUT/profile_$P.log"
    done ;;
  *) echo "usage: bash benchmarks/throughput/gpu_speed.sh gpt|gpt-modern|flow|lora|lora-compiled|qlora|lora-speed|lora-peers|flow-sampling|flow-profile|flow-variants|graphs-accum|flow-loop-profile|gpt-profile|preset-profile"; exit 2 ;;
esac
