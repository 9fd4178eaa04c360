#!/usr/bin/env bash
# On the GPU machine, from the repository root, once every part scripts/stage_fa4.sh made has been carried there
# (.devpkgs-fa4/part-00, part-01, ...: one command each, on the same machine): join the parts, check the whole
# file's SHA-256, and install the wheels into .devpkgs-fa4/site with pip (--no-index --no-deps --target), leaving out
# each package this machine's Python already has at a version that serves (fa4-packages.txt, beside the wheels,
# says which do); then import flash_attn.cute on the path scripts/device_env.sh sets, and print whether it did.
#
#   scripts/device_fa4.sh            # exit 0: installed and imported; 1: a part missing or damaged, or the import failed
#
# The site is kept apart from .devpkgs/ (scripts/stage_device.sh's), which a command that carries .devpkgs replaces
# whole; carrying .devpkgs-fa4/part-NN replaces that part alone, so the site stays for later commands.
set -euo pipefail
cd "$(dirname "$0")/.."
root=.devpkgs-fa4
shopt -s nullglob
infos=("$root"/part-*/parts.txt)
[ ${#infos[@]} -gt 0 ] || { echo "device_fa4: no parts in $root/ (run scripts/stage_fa4.sh, then carry each part)" >&2; exit 1; }
want=$(awk '$1 == "parts" {print $2}' "${infos[0]}")
sum=$(awk '$1 == "sha256" {print $2}' "${infos[0]}")
missing=()
for ((i = 0; i < want; i++)); do
  n=$(printf '%02d' "$i")
  [ -f "$root/part-$n/fa4-wheels.tar.$n" ] && grep -q "$sum" "$root/part-$n/parts.txt" || missing+=("$root/part-$n")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "device_fa4: ${#missing[@]} of $want parts missing or of another staging: ${missing[*]} (carry each in a command of its own)" >&2
  exit 1
fi
rm -rf "$root/wheels" "$root/site"
mkdir -p "$root/wheels"
for ((i = 0; i < want; i++)); do
  n=$(printf '%02d' "$i")
  cat "$root/part-$n/fa4-wheels.tar.$n"
done > "$root/fa4-wheels.tar"
got=$(sha256sum "$root/fa4-wheels.tar" | cut -d' ' -f1)
[ "$got" = "$sum" ] || { echo "device_fa4: the joined parts' SHA-256 is $got, staged $sum: stage and carry them again" >&2; exit 1; }
tar -xf "$root/fa4-wheels.tar" -C "$root/wheels"
rm -f "$root/fa4-wheels.tar"
# the wheels to install: each one's package unless this Python has a copy that serves
mapfile -t wheels < <(python3 - "$root/wheels" <<'EOF'
import re
import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging.specifiers import SpecifierSet
except ImportError:  # pip's own copy
    from pip._vendor.packaging.specifiers import SpecifierSet

folder = Path(sys.argv[1])
serves = {}
for line in (folder / "fa4-packages.txt").read_text().splitlines():
    pin, spec = line.split()[:2]
    serves[re.sub(r"[-_.]+", "-", pin.split("==")[0]).lower()] = SpecifierSet(spec)
for wheel in sorted(folder.glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if have is not None and have in serves[name]:
        print(f"device_fa4: {name} {have} is installed and serves ({serves[name]}): left out", file=sys.stderr)
        continue
    print(wheel)
EOF
)
echo "device_fa4: installing ${#wheels[@]} wheels into $root/site"
if python3 -m pip --version > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$root/site" "${wheels[@]}"
else  # no pip: wheels are zip files laid out as a site (none of these has a .data folder)
  for w in "${wheels[@]}"; do python3 -m zipfile -e "$w" "$root/site"; done
fi
rm -rf "$root/wheels"
. scripts/device_env.sh
if python3 -c "import flash_attn.cute, cutlass; print('device_fa4: import flash_attn.cute: ok (cutlass-dsl', cutlass.__version__ if hasattr(cutlass, '__version__') else '?', ')')"; then
  exit 0
fi
echo "device_fa4: import flash_attn.cute failed (above)" >&2
exit 1
