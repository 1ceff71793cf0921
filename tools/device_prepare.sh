#!/usr/bin/env bash
# Prepares the device report for a GPU machine with no package registry (run it here, on a
# machine with one): downloads the wheels of what jaxsys needs beyond that machine's own
# packages (Python 3.12, jax with its CUDA plugin, flax, optax, orbax-checkpoint, chex,
# absl-py, safetensors, tokenizers, tqdm, torch, ...) into .device_wheels/ (git-ignored),
# pinned to the versions installed here, and prints the command that runs the report there.
#
#   bash tools/device_prepare.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
wheels="$root/.device_wheels"
# jaxsys's dependencies the GPU machine lacks, and theirs (grain: array-record, cloudpickle,
# portpicker, which needs psutil).
packages=(ml-collections grain array-record cloudpickle portpicker psutil)
limit_mib=64  # what a device call carries at most

mapfile -t pins < <(python3 - "${packages[@]}" <<'PY'
import importlib.metadata, sys
for name in sys.argv[1:]:
  try:
    print(f"{name}=={importlib.metadata.version(name)}")
  except importlib.metadata.PackageNotFoundError:
    print(name)
PY
)
rm -rf "$wheels"
mkdir -p "$wheels"
if ! python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$wheels" "${pins[@]}" >"$wheels/download.log" 2>&1; then
  echo "error: downloading the wheels failed: $(grep -m1 -i error "$wheels/download.log")" >&2
  exit 1
fi
printf '%s\n' "${pins[@]}" >"$wheels/packages.txt"
mib=$(du -sm "$wheels" | cut -f1)
if (( mib > limit_mib )); then
  echo "error: .device_wheels holds ${mib} MiB, more than the ${limit_mib} MiB a device call carries" >&2
  exit 1
fi
echo "downloaded ${#pins[@]} wheels (${mib} MiB) into .device_wheels: ${pins[*]}"
echo
echo "On the GPU machine, from the repository root, carrying .device_wheels:"
echo "  bash tools/device_run.sh \"\$OUT\""
echo "(the device tool: command 'bash tools/device_run.sh \"\$OUT\"', carry ['.device_wheels'])"
