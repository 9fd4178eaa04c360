#!/usr/bin/env bash
# Stage FlashAttention-4 (`attention: fa4`) and what it imports as wheels for an offline GPU machine, in parts that
# each travel with one device command (the device tool carries at most 64 MiB a command, the checkout included):
#
#   scripts/stage_fa4.sh        # .devpkgs-fa4/part-00, part-01, ...: carry one a command, then on the same
#                               # machine scripts/device_fa4.sh joins them and installs into .devpkgs-fa4/site
#
# Wheels are fetched without dependencies for the GPU machine's interpreter: CPython $DEVICE_PYTHON (default 3.12)
# on manylinux x86_64, cutlass-dsl's CUDA 13 libraries (its cu13 extra; CUDA 12's are left out). They go into one
# tar file with a manifest (fa4-packages.txt: each wheel's package, version and the versions of a copy the machine
# may already have that serve instead), cut into as few equal parts as fit $FA4_PART_MIB MiB each (default: what
# 64 MiB leaves beside the files that travel with every command, less 3 MiB, at most 60), each part in a folder of its own with parts.txt
# (how many parts, the whole file's SHA-256). .devpkgs-fa4/ is git-ignored and rebuilt from scratch on every call.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${DEVICE_PYTHON:-3.12}
# NAME==VERSION, then what an installed copy must satisfy to be used in its place ("==": this version only): the
# pins of flash-attn-4 4.0.0b40's METADATA and of each dependency's, checked when these were chosen.
manifest=(
  "flash-attn-4==4.0.0b40 ==4.0.0b40"
  "nvidia-cutlass-dsl==4.8.1 ==4.8.1"                 # FA4: >=4.6.2; quack: >=4.7
  "nvidia-cutlass-dsl-libs-base==4.8.1 ==4.8.1"
  "nvidia-cutlass-dsl-libs-core==4.8.1 ==4.8.1"
  "nvidia-cutlass-dsl-libs-cu13==4.8.1 ==4.8.1"       # the compiler and runtime for CUDA 13 (a ~92 MB wheel)
  "quack-kernels==0.6.5 ==0.6.5"                      # FA4: >=0.5.3
  "apache-tvm-ffi==0.1.15.post2 >=0.1.11,<0.2"        # FA4's pin
  "torch-c-dlpack-ext==0.1.5 >=0.1"
  "einops==0.8.2 >=0.6"
  "typing-extensions==4.16.0 >=4.13"                  # apache-tvm-ffi's
  "cuda-pathfinder==1.9.1 >=1.4.2"                    # cuda-bindings'
  "cuda-bindings==13.5.0 >=13,<14"                    # cutlass-dsl: >=12.8; CUDA 13's (torch's cu130 build may bring one)
  "protobuf==7.36.2 >=4.21.12"                        # cutlass-dsl's
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 any; do
  platforms+=(--platform "$p")
done
rm -rf .devpkgs-fa4
mkdir -p .devpkgs-fa4/build/wheels
pins=()
for line in "${manifest[@]}"; do
  pins+=("${line%% *}")
  echo "$line" >> .devpkgs-fa4/build/wheels/fa4-packages.txt
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
  "${platforms[@]}" -d .devpkgs-fa4/build/wheels "${pins[@]}"
count=$(find .devpkgs-fa4/build/wheels -name '*.whl' | wc -l)
[ "$count" -eq "${#pins[@]}" ] || { echo "stage_fa4: expected ${#pins[@]} wheels, got $count" >&2; exit 1; }
tar -cf .devpkgs-fa4/build/fa4-wheels.tar --sort=name -C .devpkgs-fa4/build/wheels .
# what travels with every command: tracked files and untracked ones git does not ignore
tree=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
part_mib=${FA4_PART_MIB:-$(( (64 * 1048576 - tree) / 1048576 - 3 ))}
[ "$part_mib" -le 60 ] || part_mib=60
[ "$part_mib" -ge 8 ] || { echo "stage_fa4: the checkout takes $(( tree / 1048576 )) MiB of 64: no room for parts" >&2; exit 1; }
total=$(stat -c %s .devpkgs-fa4/build/fa4-wheels.tar)
most=$(( part_mib * 1048576 ))
n=$(( (total + most - 1) / most ))
size=$(( (total + n - 1) / n ))  # as few parts as fit, of equal size
split -b "$size" -d -a 2 .devpkgs-fa4/build/fa4-wheels.tar .devpkgs-fa4/build/fa4-wheels.tar.
sum=$(sha256sum .devpkgs-fa4/build/fa4-wheels.tar | cut -d' ' -f1)
parts=$(find .devpkgs-fa4/build -name 'fa4-wheels.tar.[0-9]*' | wc -l)
for chunk in .devpkgs-fa4/build/fa4-wheels.tar.[0-9]*; do
  n=${chunk##*.}
  mkdir -p ".devpkgs-fa4/part-$n"
  mv "$chunk" ".devpkgs-fa4/part-$n/"
  printf 'parts %s\nsha256 %s\n' "$parts" "$sum" > ".devpkgs-fa4/part-$n/parts.txt"
done
echo "stage_fa4: $count wheels, $total bytes in $parts parts of $size bytes or less (at most $part_mib MiB: the" \
     "checkout that travels with each is $(( tree / 1048576 )) MiB)"
rm -rf .devpkgs-fa4/build
for d in .devpkgs-fa4/part-*; do
  echo "  $d: $(du -sm "$d" | cut -f1) MiB  (carry [\"$d\"])"
done
