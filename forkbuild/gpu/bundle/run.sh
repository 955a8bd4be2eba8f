#!/usr/bin/env bash
# The fork's GPU bundle on an air-gapped GPU host (made by `make gpu-bundle`; see
# docs/gpu-nightly.md, "On an air-gapped GPU host"). Bash and the host's python3, no network.
#   bash run.sh --inventory     what this host has, as a host file: make gpu-bundle GPU_HOST=FILE
#   bash run.sh --install DEST  verify and unpack the parts present into DEST (prints PYTHONPATH)
#   bash run.sh OUT             verify, unpack and run the GPU cases the parts present allow;
#                               JUnit XML, summary.json and summary.txt go to OUT
# PYTHON names another interpreter; FORK_BUNDLE_HOME where the parts unpack (default /tmp).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
if ! command -v "$python" >/dev/null 2>&1; then
  echo "run.sh: no $python on PATH -- give the host's interpreter: PYTHON=/path/to/python3 bash run.sh ..." >&2
  exit 2
fi
# The runner is checked before it runs: part 1's own files, as SHA256SUMS lists them.
if ! (cd "$here" && sha256sum --check --quiet --strict SHA256SUMS >/dev/null 2>&1); then
  echo "run.sh: part 1 is damaged or incomplete ($(cd "$here" && sha256sum --check --quiet SHA256SUMS 2>&1 | head -1)) -- transfer run.sh, SHA256SUMS, manifest.json, runner/ and part-1/ again" >&2
  exit 2
fi
export PYTHONPATH="$here/runner"
case "${1:-}" in
  --inventory) exec "$python" -m forkbuild.gpu.bundle.runner inventory ;;
  --install) [ $# -eq 2 ] || { echo "usage: bash run.sh --install DEST" >&2; exit 2; }
             exec "$python" -m forkbuild.gpu.bundle.runner install "$here" "$2" ;;
  ""|-*) echo "usage: bash run.sh --inventory | --install DEST | OUT" >&2; exit 2 ;;
  *) exec "$python" -m forkbuild.gpu.bundle.runner run "$here" "$1" ;;
esac
