#!/usr/bin/env bash
# On the GPU (nvidia-h100-x1 or nvidia-h200), one call of at most ~9 minutes: DPO of the Pythia-1.4B shape on zh-poetry
# preference pairs, TRL DPOTrainer (LoRA, ref_model=None) against hf-cgpu train dpo (padded, packed): pairs/s, peak
# memory, reward accuracy on held-out pairs after the same pass (benchmarks/finetune/bench_dpo_vs_trl.py); then, in the
# time left, QLoRA instruction LoRA against TRL SFTTrainer padded: peak memory and response tokens/s
# (benchmarks/finetune/bench_sft_vs_trl.py --rows trl_padded,ours_qlora_recompute,ours_qlora).
# Carry .whl (../shared/tools/device-wheels.sh plus trl-1.16.0-py3-none-any.whl: `pip download trl==1.16.0 --no-deps
# -d .whl`) and .data/zh-poetry (a copy of ../shared/data/zh-poetry). Every phase has a deadline inside the call:
# DPO_DEADLINE (default 300 s) for the DPO rows, the rest up to DEADLINE (default 530 s) for the SFT rows.
# DPO_ROWS / SFT_ROWS pick rows (DPO: ours, trl, ours_packed, ours_low = packed + recompute, no CUDA graphs),
# EXAMPLES the SFT examples (default 1000). SMOKE=1: the same chain at toy sizes on the
# CPU, three times the deadlines (TRL importable: `pip install trl==1.16.0`; ZH=../shared/data/zh-poetry reads the data in
# place). Writes 8 files to OUT: bench.log (environment and both benches' output), dpo_vs_trl.md/.jsonl, dpo_rows.log,
# sft_vs_trl.md/.jsonl, rows.log, data.json.
start=$(date +%s)
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
if [ "${SMOKE:-0}" = 1 ]; then
  source benchmarks/gpu_env.sh --cpu; smoke=--smoke; work=/tmp/dpo_smoke_$$
else
  source benchmarks/gpu_env.sh --gpu || exit 1; smoke=; work=/tmp/dpo_vs_trl_work
fi
log=$OUT/bench.log
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  python3 -c "import torch,transformers,peft,trl;print('torch',torch.__version__,'transformers',transformers.__version__,'peft',peft.__version__,'trl',trl.__version__)"
} > "$log" 2>&1
[ "${SMOKE:-0}" = 1 ] && slow=3 || slow=1  # a shared CPU: the toy rows take minutes, not seconds
dpo_deadline=${DPO_DEADLINE:-$((300 * slow))}
zh=${ZH:-.data/zh-poetry}
timeout $((dpo_deadline + 30)) python3 benchmarks/finetune/bench_dpo_vs_trl.py $smoke --zh "$zh" --out "$OUT" \
  --work "$work/dpo" --deadline "$dpo_deadline" ${DPO_ROWS:+--rows $DPO_ROWS} >> "$log" 2>&1
echo "dpo bench exit $? after $(( $(date +%s) - start )) s" >> "$log"
left=$(( ${DEADLINE:-$((530 * slow))} - ($(date +%s) - start) ))
if [ "$left" -gt 60 ]; then
  timeout $((left + 20)) python3 benchmarks/finetune/bench_sft_vs_trl.py $smoke --zh "$zh" --out "$OUT" \
    --work "$work/sft" --deadline "$left" --examples ${EXAMPLES:-1000} \
    --rows ${SFT_ROWS:-trl_padded,ours_qlora_recompute,ours_qlora} >> "$log" 2>&1
  echo "sft bench exit $? after $(( $(date +%s) - start )) s" >> "$log"
else
  echo "sft bench skipped: ${left} s left" >> "$log"
fi
[ "${SMOKE:-0}" = 1 ] && rm -rf "$work"
cat "$OUT"/dpo_vs_trl.md "$OUT"/sft_vs_trl.md 2>/dev/null
tail -5 "$log"
