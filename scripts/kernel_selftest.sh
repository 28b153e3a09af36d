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

build_and_run() {  # compiler, runner (may be empty), tier define, tier flags...
  local cxx=$1 runner=$2 tier=$3
  shift 3
  "$cxx" "${common[@]}" -DNANOSERVE_ENTRY=nanoserve_kernels_reference -c reference.cpp -o "$out/ref.o"
  "$cxx" "${common[@]}" "$@" -D"$tier" -DNANOSERVE_ENTRY=nanoserve_kernels_tier -c vector.cpp -o "$out/tier.o"
  "$cxx" "${common[@]}" -D"$tier" $([ -n "$runner" ] && echo -static) selftest.cpp "$out/ref.o" "$out/tier.o" \
    -o "$out/selftest"
  $runner "$out/selftest"
}

case $mode in
  native)
    if [ "$(uname -m)" != x86_64 ]; then
      echo "kernel self-test: the native run covers the x86 tiers; this is $(uname -m)"
      exit 0
    fi
    cxx=${CXX:-c++}
    build_and_run "$cxx" "" NANOSERVE_TIER_AVX512_VNNI -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c -mfma
    build_and_run "$cxx" "" NANOSERVE_TIER_AVX_VNNI -mavx2 -mavxvnni -mf16c -mfma
    build_and_run "$cxx" "" NANOSERVE_TIER_AVX2 -mavx2 -mf16c -mfma
    ;;
  arm)
    cxx=aarch64-linux-gnu-g++
    if ! command -v "$cxx" >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
      echo "kernel self-test (ARM) skipped: needs $cxx and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user)"
      exit 0
    fi
    build_and_run "$cxx" "qemu-aarch64 -cpu max" NANOSERVE_TIER_NEON_DOT -march=armv8.2-a+dotprod
    build_and_run "$cxx" "qemu-aarch64 -cpu max" NANOSERVE_TIER_NEON -march=armv8-a
    ;;
  *)
    echo "usage: $0 native|arm" >&2
    exit 2
    ;;
esac
