#!/usr/bin/env bash
# Runs the device report on a GPU machine with no package registry, from the wheels that
# tools/device_prepare.sh downloaded into .device_wheels/: installs them into .device_site/
# (beside the machine's own packages; jaxsys itself runs from this checkout) and writes the
# report into OUT_DIR.
#
#   bash tools/device_run.sh OUT_DIR [experiments.device_report flags]
set -uo pipefail
out="${1:-}"
if [[ -z "$out" ]]; then
  echo "error: OUT_DIR is missing: bash tools/device_run.sh OUT_DIR [report flags]" >&2
  exit 1
fi
shift
root="$(cd "$(dirname "$0")/.." && pwd)"
wheels="$root/.device_wheels"
site="$root/.device_site"
if [[ ! -f "$wheels/packages.txt" ]]; then
  echo "error: $wheels/packages.txt is missing: run tools/device_prepare.sh on a machine with a package registry and carry .device_wheels" >&2
  exit 1
fi
shopt -s nocaseglob nullglob
while read -r pin; do
  name="${pin%%==*}"
  found=("$wheels/${name//-/_}"-*.whl)
  if (( ${#found[@]} == 0 )); then
    echo "error: no wheel for $pin in .device_wheels: run tools/device_prepare.sh again and carry .device_wheels" >&2
    exit 1
  fi
done <"$wheels/packages.txt"
mkdir -p "$site"
if ! python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" \
    "$wheels"/*.whl >"$site/install.log" 2>&1; then
  echo "error: installing the wheels failed: $(grep -m1 -i error "$site/install.log")" >&2
  exit 1
fi
cd "$root" || exit 1
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m experiments.device_report \
    --out="$out" "$@"
