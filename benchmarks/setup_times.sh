#!/usr/bin/env bash
# Set-up times of two commits of the fork side by side, in one run on this machine: for each,
# a fresh clone (its own build/) with the download cache as it is (warm when this machine has
# run `make` before), then `make install`, then `make serve` until the first completion
# answers. Prints one table; the README's set-up figures come from it.
#   bash benchmarks/setup_times.sh [OLD_REF [NEW_REF]]     (defaults: HEAD~1 and HEAD)
# The OLD_REF's own cache layout is used as it is (e.g. the pip wheelhouse before uv).
set -euo pipefail
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
old=${1:-HEAD~1}
new=${2:-HEAD}
work=$(mktemp -d /tmp/setup-times.XXXX)
port=8300
python=${PYTHON:-python3}

now() { date +%s.%N; }
secs() { printf '%.0f' "$(echo "$2 - $1" | bc)"; }

first_completion() {  # clone port -> seconds from `make serve` to the first completion
  local clone=$1 port=$2 start pid model
  start=$(now)
  (cd "$clone" && exec make serve PORT="$port" PYTHON="$python") >"$clone.serve.log" 2>&1 &
  pid=$!
  until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
    kill -0 "$pid" 2>/dev/null || { echo "make serve died, see $clone.serve.log" >&2; exit 1; }
    sleep 0.5
  done
  model=$(curl -s "http://127.0.0.1:$port/v1/models" | "$python" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
  curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"prompt\": \"Hello\", \"max_tokens\": 8}" >/dev/null
  secs "$start" "$(now)"
  pkill -INT -P "$pid" 2>/dev/null || true
  pkill -INT -f -- "--port $2" 2>/dev/null || true
  kill -INT "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  sleep 2
}

declare -A install serve
for ref in "$old" "$new"; do
  clone="$work/$(git -C "$repo" rev-parse --short "$ref")"
  git clone -q "$repo" "$clone"
  git -C "$clone" checkout -q "$(git -C "$repo" rev-parse "$ref")"
  echo "== $ref: make install in a fresh clone ($clone)" >&2
  start=$(now)
  (cd "$clone" && make install PYTHON="$python") >"$clone.install.log" 2>&1
  install[$ref]=$(secs "$start" "$(now)")
  rm -rf "$clone/build"  # serve measures a fresh clone too
  echo "== $ref: make serve to the first completion" >&2
  serve[$ref]=$(first_completion "$clone" $((port++)))
done

printf '\n| fresh clone, this cache | %s | %s | new / old |\n| --- | --- | --- | --- |\n' "$old" "$new"
for what in install serve; do
  declare -n t=$what
  printf '| `make %s`%s | %s s | %s s | %.2f |\n' "$what" \
    "$([ "$what" = serve ] && echo ', to the first completion')" \
    "${t[$old]}" "${t[$new]}" "$(echo "${t[$new]} / ${t[$old]}" | bc -l)"
done
echo "logs: $work"
