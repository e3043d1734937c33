#!/usr/bin/env bash
# The SmolLM2 GGUF (98.4 MB) is larger than what one device call carries (64 MiB with the tree, .whl and
# .data/zh-poetry), so it travels in three parts, one per call, on a machine kept warm between the calls.
#
#   bash benchmarks/tools/gguf_parts.sh split     here: .gguf-parts/0, /1, /2 (~33 MB each, ignored by git) + sha256, and
#                                           the gguf wheel in part 0; carry ".gguf-parts/N" in the Nth call
#   bash benchmarks/tools/gguf_parts.sh stash     there, at the start of any call: copies the carried part to /tmp (a warm
#                                           machine keeps /tmp) and, once all three are there, joins and checks them
#                                           into /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf; says what is missing
set -euo pipefail
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
  split)
    src=$(python3 -c "from hf_cgpu.gguf import smollm2_gguf; print(smollm2_gguf())")
    grep -qx '/.gguf-parts/' .git/info/exclude 2>/dev/null || echo '/.gguf-parts/' >> .git/info/exclude
    rm -rf .gguf-parts && mkdir -p .gguf-parts/0 .gguf-parts/1 .gguf-parts/2
    size=$(stat -c %s "$src"); chunk=$(( (size + 2) / 3 ))
    for i in 0 1 2; do dd if="$src" of=.gguf-parts/$i/part bs=$chunk skip=$i count=1 status=none; done
    sha256sum "$src" | cut -d' ' -f1 | tee .gguf-parts/0/sha256 .gguf-parts/1/sha256 > .gguf-parts/2/sha256
    python3 -m pip download -q --no-deps --only-binary=:all: -d .gguf-parts/0 gguf 2>&1 | grep -v 'is ignored' || true
    du -sh .gguf-parts/* ;;
  stash)
    mkdir -p /tmp/gguf-parts /tmp/gguf
    for i in 0 1 2; do
      if [ -f .gguf-parts/$i/part ]; then cp .gguf-parts/$i/part /tmp/gguf-parts/$i; cp .gguf-parts/$i/sha256 /tmp/gguf-parts/sha256; fi
      ls .gguf-parts/$i/gguf-*.whl > /dev/null 2>&1 && cp .gguf-parts/$i/gguf-*.whl /tmp/gguf-parts/
    done
    if [ -f /tmp/gguf/$NAME ]; then echo "gguf: /tmp/gguf/$NAME ready"; exit 0; fi
    missing=$(for i in 0 1 2; do [ -f /tmp/gguf-parts/$i ] || echo -n "$i "; done)
    if [ -n "$missing" ]; then echo "gguf: parts missing on this machine: $missing(carry .gguf-parts/N)"; exit 0; fi
    cat /tmp/gguf-parts/0 /tmp/gguf-parts/1 /tmp/gguf-parts/2 > /tmp/gguf/$NAME.tmp
    if [ "$(sha256sum /tmp/gguf/$NAME.tmp | cut -d' ' -f1)" = "$(cat /tmp/gguf-parts/sha256)" ]; then
      mv /tmp/gguf/$NAME.tmp /tmp/gguf/$NAME && echo "gguf: /tmp/gguf/$NAME joined, sha256 checked"
    else
      rm -f /tmp/gguf/$NAME.tmp; echo "gguf: the joined parts do not match the sha256: carry them again"
    fi ;;
  *) echo "usage: bash benchmarks/tools/gguf_parts.sh split|stash" >&2; exit 2 ;;
esac
