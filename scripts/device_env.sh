# Source on the GPU machine from the repo root, with .devpkgs/ (made by scripts/stage_device.sh) copied along.
export PYTHONPATH=$PWD/.devpkgs/site:$PWD
# FlashAttention-4 and what it imports, where scripts/device_fa4.sh installed them (`attention: fa4`); cutlass-dsl's
# own packages by name, as the .pth file of its wheel adds them in a site-packages folder
if [ -d "$PWD/.devpkgs-fa4/site" ]; then
  PYTHONPATH=$PYTHONPATH:$PWD/.devpkgs-fa4/site:$PWD/.devpkgs-fa4/site/nvidia_cutlass_dsl/dsl_packages
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
poros() { python3 -m poros "$@"; }
# tox with its own packages first on its path: `devtox -e installed -- --matrix=h200 --steps 2 -k ...`
devtox() { PYTHONPATH=$PWD/.devpkgs/tox:$PYTHONPATH python3 -m tox "$@"; }
# The copied tree has no .git: pass the commit in, e.g. `export POROS_GIT_COMMIT=$(git rev-parse HEAD)`
# evaluated here before the call, so results record what ran.
