#!/usr/bin/env bash
# Stage the Python packages an offline GPU machine lacks into .devpkgs/site, to be copied along
# with the checkout; there, `. scripts/device_env.sh` puts them on the path.
#
#   scripts/stage_device.sh                      # bitsandbytes, Unsloth with what it imports, pytest-benchmark
#                                                # and pygal (its --benchmark-histogram); tox apart (.devpkgs/tox)
#   scripts/stage_device.sh NAME==VERSION ...    # these packages instead
#
# Wheels are fetched without dependencies for the GPU machine's interpreter, not this one's:
# CPython $DEVICE_PYTHON (default 3.12) on manylinux x86_64. bitsandbytes keeps only its CPU library
# and the CUDA one named by $DEVICE_CUDA (default 130, i.e. CUDA 13.0): the full wheel is ~60 MB.
# Unsloth's web UI (82 MiB) and CLI, and test folders, are dropped: training imports none of them.
# .devpkgs/ is git-ignored and rebuilt from scratch on every call (about 30 MiB with the defaults).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${DEVICE_PYTHON:-3.12}
cuda=${DEVICE_CUDA:-130}
pkgs=("$@")
[ ${#pkgs[@]} -gt 0 ] || pkgs=(bitsandbytes==0.49.2 unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0
                               datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 pytest-benchmark==5.3.1
                               pygal==3.1.3 pygaljs==1.0.2)
rm -rf .devpkgs
mkdir -p .devpkgs/wheels .devpkgs/site
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 any; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
  "${platforms[@]}" -d .devpkgs/wheels "${pkgs[@]}"
for w in .devpkgs/wheels/*.whl; do
  python3 -m zipfile -e "$w" .devpkgs/site
done
rm -rf .devpkgs/wheels
if [ -d .devpkgs/site/bitsandbytes ]; then
  find .devpkgs/site/bitsandbytes -maxdepth 1 -name 'libbitsandbytes_*.so' \
    ! -name "libbitsandbytes_cuda${cuda}.so" ! -name 'libbitsandbytes_cpu.so' -delete
fi
# tox and what it imports, apart: on the path of the tox process alone (device_env.sh's `devtox`), so that none of
# them shadows the machine's own copies for everything else
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
  "${platforms[@]}" -d .devpkgs/tox-wheels tox==4.67.15 virtualenv==21.15.11 distlib==0.4.4 filelock==4.3.1 \
  platformdirs==4.14.9 pluggy==1.7.0 pyproject-api==1.12.1 cachetools==8.0.2 colorama==0.4.6 packaging==26.4 \
  python-discovery==1.9.6 tomli-w==1.2.0 typing-extensions==4.16.0
for w in .devpkgs/tox-wheels/*.whl; do
  python3 -m zipfile -e "$w" .devpkgs/tox
done
rm -rf .devpkgs/tox-wheels
rm -rf .devpkgs/site/studio .devpkgs/site/unsloth_cli .devpkgs/site/dill/tests .devpkgs/site/multiprocess/tests
du -sh .devpkgs
