#!/usr/bin/env bash
# The CPU kernels' standalone self-test (nanoserve/model/quant/kernels/selftest.cpp, no torch): each
# tier against the scalar reference, built with the tier's own flags.
#   scripts/kernel_selftest.sh native   every x86 tier, run on this host (a tier the CPU lacks says so)
#   scripts/kernel_selftest.sh arm      the NEON tiers, cross-compiled and run under qemu-user
# The ARM run needs Debian's g++-aarch64-linux-gnu and qemu-user; without them it prints why and
# exits 0.
set -euo pipefail
cd "$(dirname "$0")/../nanoserve/model/quant/kernels"
mode=${1:-native}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(-O2 -std=c++17 -ffp-contract=off)

build() {  # compiler, static (yes/no), tier define, output dir, tier flags...
  local cxx=$1 static=$2 tier=$3 dir=$4
  shift 4
  mkdir -p "$dir"
  "$cxx" "${common[@]}" -DNANOSERVE_ENTRY=nanoserve_kernels_reference -c reference.cpp -o "$dir/ref.o"
  "$cxx" "${common[@]}" "$@" -D"$tier" -DNANOSERVE_ENTRY=nanoserve_kernels_tier -c vector.cpp -o "$dir/tier.o"
  "$cxx" "${common[@]}" -D"$tier" $([ "$static" = yes ] && echo -static) selftest.cpp "$dir/ref.o" "$dir/tier.o" \
    -o "$dir/selftest"
}

# The tiers build side by side (a compiler a core), then run one after another.
wait_all() {
  local job
  for job in $(jobs -p); do wait "$job"; done
}

case $mode in
  native)
    if [ "$(uname -m)" != x86_64 ]; then
      echo "kernel self-test: the native run covers the x86 tiers; this is $(uname -m)"
      exit 0
    fi
    cxx=${CXX:-c++}
    build "$cxx" no NANOSERVE_TIER_AVX512_VNNI "$out/avx512-vnni" -mavx512f -mavx512bw -mavx512vl -mavx512vnni \
      -mf16c -mfma &
    build "$cxx" no NANOSERVE_TIER_AVX_VNNI "$out/avx-vnni" -mavx2 -mavxvnni -mf16c -mfma &
    build "$cxx" no NANOSERVE_TIER_AVX2 "$out/avx2" -mavx2 -mf16c -mfma &
    wait_all
    for tier in avx512-vnni avx-vnni avx2; do "$out/$tier/selftest"; done
    ;;
  arm)
    cxx=aarch64-linux-gnu-g++
    if ! command -v "$cxx" >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
      echo "kernel self-test (ARM) skipped: needs $cxx and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user)"
      exit 0
    fi
    build "$cxx" yes NANOSERVE_TIER_NEON_DOT "$out/neon-dot" -march=armv8.2-a+dotprod &
    build "$cxx" yes NANOSERVE_TIER_NEON "$out/neon" -march=armv8-a &
    wait_all
    for tier in neon-dot neon; do qemu-aarch64 -cpu max "$out/$tier/selftest"; done
    ;;
  *)
    echo "usage: $0 native|arm" >&2
    exit 2
    ;;
esac
