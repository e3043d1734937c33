#!/usr/bin/env bash
# Fetch Unsloth and the wheels it needs beyond ../shared/tools/device-wheels.sh into ./.whl-unsloth (run from the
# project root, on this machine: the GPU machine reaches no registry), for `bash benchmarks/throughput/gpu_speed.sh lora-peers`.
# The unsloth wheel is 28.6 MB, 24 of them its `studio/` web app; it is repacked without it so that .whl +
# .whl-unsloth (~30 MB) travel in one call. Not fetched: xformers (optional for Unsloth; SDPA is used without it).
# Pins follow unsloth 2026.10.9's metadata (trl <= 1.15, transformers <= 5.17: the GPU machine has 5.17.0) and
# torchvision 0.26 for its torch 2.11.
set -euo pipefail
grep -qx '/.whl-unsloth/' .git/info/exclude 2>/dev/null || echo '/.whl-unsloth/' >> .git/info/exclude
dest=$PWD/.whl-unsloth
mkdir -p "$dest"
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$1" "${@:2}" 2>&1 | grep -v 'is ignored' || true; }
dl "$dest" "unsloth_zoo==${UNSLOTH_VERSION:-2026.10.9}" "torchvision==0.26.0" "trl==1.15.0" torchao tyro \
  cut_cross_entropy msgspec sentencepiece typer json5 nest-asyncio structlog docstring-parser shtab typeguard \
  hf_transfer gguf
if ! ls "$dest"/unsloth-2*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  dl "$tmp" "unsloth==${UNSLOTH_VERSION:-2026.10.9}"
  whl=$(basename "$tmp"/unsloth-2*.whl)
  mkdir "$tmp/x" && (cd "$tmp/x" && unzip -q "../$whl" && rm -rf studio && zip -qr "$dest/$whl" .) \
    || { echo "unsloth repack failed"; exit 1; }
  rm -rf "$tmp"
fi
ls -la "$dest"; du -sh "$dest"
