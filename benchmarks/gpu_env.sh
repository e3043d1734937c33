# The environment of the benchmark scripts, sourced from the project root (not run):
#
#   source benchmarks/gpu_env.sh --gpu [EXTRA.whl ...] || exit 1   on the lent GPU machine: install the carried wheels
#   source benchmarks/gpu_env.sh --auto || exit 1                  --gpu when .whl/ holds wheels, else --cpu
#   source benchmarks/gpu_env.sh --cpu                             a CPU check of a script: no install
#
# The GPU machine has torch, transformers, accelerate, peft, but no diffusers, datasets or bitsandbytes, and no
# package registry (../shared/docs/gpu.md). `bash ../shared/tools/device-wheels.sh`, run here from the project root,
# puts them into .whl/; each device call carries ".whl" (and the data it reads, e.g. .data/zh-poetry). --gpu installs
# .whl/*.whl, and any EXTRA wheels, into /tmp/site and puts the checkout and /tmp/site on PYTHONPATH; it returns 1,
# and the script exits, when that install fails (no .whl/ carried, say). --cpu puts only the checkout in front of
# PYTHONPATH. All modes then export HF_CGPU_CACHE (/tmp/hfc unless already set: compiled kernels and decoded data
# kept between the runs of a call and of calls on a warm machine) and PYTHONUNBUFFERED=1 (logs written as they come).
# Always pass the mode: a sourced file without arguments sees the calling script's own arguments.
case "${1:-}" in
  --auto) if ls .whl/*.whl > /dev/null 2>&1; then _gpu_env_mode=--gpu; else _gpu_env_mode=--cpu; fi ;;
  --gpu|--cpu) _gpu_env_mode=$1 ;;
  *) echo "usage: source benchmarks/gpu_env.sh --gpu [EXTRA.whl ...] | --auto | --cpu" >&2; return 2 ;;
esac
shift
if [ "$_gpu_env_mode" = --gpu ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl "$@" \
    || { unset _gpu_env_mode; return 1; }
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
unset _gpu_env_mode
export HF_CGPU_CACHE=${HF_CGPU_CACHE:-/tmp/hfc} PYTHONUNBUFFERED=1
