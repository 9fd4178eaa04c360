#!/usr/bin/env bash
# One part of a matrix run in parts, on a GPU machine without a package index, from the repository root with
# .devpkgs/ copied along (scripts/stage_device.sh), e.g.
#   scripts/matrix_part.sh matrices/h200-long-context.yaml results/h200-long-context/32k 8.5
#   scripts/matrix_part.sh matrices/h200-copy-floor.yaml results/h200-copy-floor 8.5 -k "plan:24GB"
# Arguments: MATRIX, RESULTS (the run's folder: the first part creates it, a later part continues from the rows
# and passes an earlier part of the same commit left there; `--resume` refuses another commit's), MINUTES (`--max-minutes`: no pass starts that would end past it; default 8.5), then any further
# `poros bench matrix` options. A watchdog interrupts the run 45 s after MINUTES (SIGINT, so pytest still writes
# its files) should a cell's set-up outlast the budget. The GPU's name and UUID go to RESULTS/gpu.txt, and the
# run's files (and gate-references/, the digests of a gate's reference kept for the next part) are copied to $OUT
# (default out/) every 20 s while it runs and when it ends, so that a part killed
# from outside still leaves its finished passes there (a line cut mid-copy is set aside by the next `--resume`):
# copy them back into the checkout and commit them before the next part, which continues from them. A run started in
# the background (setsid) to outlast the command that started it writes RESULTS and $OUT outside the checkout
# (e.g. /tmp/...) wherever the checkout may be refreshed between commands: a refresh removes a folder the checkout
# does not track, and the run's own files with it. Exit status: the run's (75: stopped at MINUTES with cells left).
set -uo pipefail
matrix=${1:?usage: scripts/matrix_part.sh MATRIX RESULTS [MINUTES] [poros bench options]}
results=${2:?usage: scripts/matrix_part.sh MATRIX RESULTS [MINUTES] [poros bench options]}
minutes=${3:-8.5}
shift $(( $# < 3 ? $# : 3 ))
. scripts/device_env.sh
export POROS_WORKDIR=${POROS_WORKDIR:-/tmp} CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
[ -n "${POROS_GIT_COMMIT:-}" ] || echo "matrix_part: POROS_GIT_COMMIT is not set: the rows will name no commit" >&2
out=${OUT:-out}
mkdir -p "$out" "$results"
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader > "$results/gpu.txt" || true
cat "$results/gpu.txt"
copy_out() {
  for f in results.jsonl passes.jsonl benchmark.json bench.log report.md gpu.txt matrix.yaml; do
    [ -f "$results/$f" ] && cp "$results/$f" "$out/"
  done
  if compgen -G "$results/gate-references/*.json.gz" > /dev/null; then
    mkdir -p "$out/gate-references" && cp "$results"/gate-references/*.json.gz "$out/gate-references/"
  fi
  return 0
}
(while sleep 20; do copy_out; done) &
copier=$!
limit=$(python3 -c "import sys; print(int(float(sys.argv[1]) * 60 + 45))" "$minutes")
timeout -s INT -k 30 "$limit" python3 -m poros bench matrix "$matrix" -o "$results" --resume \
  --max-minutes "$minutes" "$@"
status=$?
kill "$copier" 2>/dev/null
wait "$copier" 2>/dev/null
echo "matrix_part: exit $status"
copy_out
exit $status
