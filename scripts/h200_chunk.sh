#!/usr/bin/env bash
# One resumable chunk of the H200 matrix, run on the GPU machine from the repo root, e.g.
#   scripts/h200_chunk.sh "qwen2.5-32b or qwen3-32b" 20 3
# MATRIX (default matrices/h200.yaml) and RESULTS (default results/h200) pick another matrix, e.g.
#   MATRIX=matrices/h200-long.yaml RESULTS=results/h200-long scripts/h200_chunk.sh qwen 10 3
# Finished cells are appended to $RESULTS/results.jsonl and kept when the chunk is cut off by
# its time budget (BUDGET seconds, default 540); copy that file back into the checkout after each
# call so the next chunk's --resume skips them. Needs .devpkgs carried (scripts/stage_device.sh).
set -uo pipefail
. scripts/device_env.sh
export POROS_WORKDIR=${POROS_WORKDIR:-/tmp}
keyword=$1 steps=${2:-20} passes=${3:-3}
out=${OUT:-out}
mkdir -p "$out"
# SIGINT, not SIGTERM: pytest then ends the session normally, so the cut-off chunk still writes
# its pytest-benchmark JSON and summary (finished cells are in results.jsonl either way).
timeout -s INT -k 30 "${BUDGET:-540}" python3 -m poros bench matrix "${MATRIX:-matrices/h200.yaml}" -o "${RESULTS:-results/h200}" \
  --steps "$steps" --passes "$passes" --resume -k "$keyword" > "$out/bench.log" 2>&1
echo "bench exit $?"
grep -E '^\[cell|^  (parity|poros|resident|unsloth)[: ]|passed|failed|Error' "$out/bench.log" | grep -v 'step [0-9]*/' | tail -40
cp "${RESULTS:-results/h200}/results.jsonl" "$out/results.jsonl" 2>/dev/null
cp "${RESULTS:-results/h200}/benchmark.json" "$out/benchmark.json" 2>/dev/null
exit 0
