#!/usr/bin/env bash
# Stage what the offline H200 image lacks into .devpkgs/ (carry it with every device call):
# bitsandbytes, and Unsloth with the packages it imports at start. ~30 MiB once pruned.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
../shared/device/stage.sh bitsandbytes==0.49.2 unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 \
  datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
# Unsloth's wheel carries its web UI (82 MiB) and CLI; neither is imported for training.
rm -rf .devpkgs/site/studio .devpkgs/site/unsloth_cli .devpkgs/site/dill/tests .devpkgs/site/multiprocess/tests
du -sh .devpkgs
