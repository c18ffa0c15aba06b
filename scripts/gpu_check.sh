#!/usr/bin/env bash
# The GPU check in one command (docs/performance.md, "The GPU check"):
#
#   scripts/gpu_check.sh [OUT]    OUT: a new directory for the report, the logs and
#                                 the venv (default /tmp/cifar10_gpu_check_<date>)
#
# On a machine with an NVIDIA GPU, from a bare machine (a python3 with venv, and
# the package registry): installs this checkout with its `gpu` and `profile`
# extras in a fresh venv, then runs one after the other, each under a time limit
# so that all of it, the install included, ends within 8 minutes:
#   the cross-check on 2 towers (two logical GPUs of one GPU), TF32 off;
#   legacy and modern for 300 steps on 2 towers, each then `eval --run_once`;
#   `bench --num_gpus 1,2`; `profile` of each trainer on 2 towers.
# Each stage adds its part to OUT/gpu_check.json as it finishes: its command,
# exit status (null: skipped, out of time; 124: timed out), seconds, log file, the
# figure its log ends with, and what the CLI wrote as JSON (bench's --json,
# profile's report.json). At the end it prints a table of the stages and the
# bench's table.
#
# Without a GPU it says so in one line and exits 2. GPU_CHECK_DRY=1 needs no GPU
# and installs nothing: each stage writes its command to its log instead of
# running it (tests/test_gpu_check.py).
#
# Only pip and `python cli.py` run here; the rest is bookkeeping.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY="${GPU_CHECK_DRY:-}"
DEADLINE=480  # seconds from the start, the install included
OUT="${1:-/tmp/cifar10_gpu_check_$(date -u +%Y%m%d_%H%M%S)}"

if [ -z "$DRY" ] && ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L lists none), so nothing to check." >&2
  exit 2
fi
case "$OUT" in
  *[\"\\]*) echo "gpu_check: $OUT: name the output directory without quotes or backslashes." >&2
            exit 2 ;;
esac
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "gpu_check: $OUT is not empty; give a new directory (its train_dirs would resume)." >&2
  exit 2
fi
mkdir -p "$OUT/logs" || exit 1

STARTED="$(date -u '+%Y-%m-%d %H:%M UTC')"
if [ -n "$DRY" ]; then
  GPUS='none (dry run)'
else
  GPUS="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
          | tr -d '"\\' | paste -sd ';' -)"
fi
PY="$OUT/venv/bin/python"
DATA="$OUT/data"
parts=() names=() exits=() times=() figures=()

write_report() {  # the stages so far, as one JSON object, replaced whole
  local IFS=,
  printf '{"check": "scripts/gpu_check.sh", "started": "%s", "gpus": "%s", "deadline_seconds": %d, "stages": [%s]}\n' \
    "$STARTED" "$GPUS" "$DEADLINE" "${parts[*]}" > "$OUT/gpu_check.json.part" &&
    mv "$OUT/gpu_check.json.part" "$OUT/gpu_check.json"
}

# stage NAME LIMIT JSON_FILE FIGURE_PATTERN COMMAND...: runs COMMAND (at most LIMIT
# seconds, less if the deadline is nearer), its output in OUT/logs/NAME.log; then
# adds its part: JSON_FILE's contents (if not -) and the log's last FIGURE_PATTERN match.
stage() {
  local name="$1" limit="$2" json="$3" pattern="$4" log="$OUT/logs/$1.log"
  shift 4
  local start=$SECONDS left=$((DEADLINE - SECONDS)) status figure report=null
  [ "$limit" -gt "$left" ] && limit=$left
  echo "--- [$((SECONDS / 60))m$((SECONDS % 60))s] $name: $*"
  if [ "$limit" -le 0 ]; then
    status=null
    echo "skipped: the ${DEADLINE} s were spent" > "$log"
  elif [ -n "$DRY" ]; then
    echo "$*" > "$log"
    status=$?
  else
    timeout "$limit" "$@" > "$log" 2>&1
    status=$?
  fi
  figure="$(grep -oE "$pattern" "$log" | tail -n 1 | tr -d '"\\')"
  [ "$json" != - ] && [ -s "$json" ] && report="$(cat "$json")"
  parts+=("{\"stage\": \"$name\", \"command\": \"$(tr -d '"\\' <<<"$*")\", \"exit\": $status, \"seconds\": $((SECONDS - start)), \"log\": \"$log\", \"figure\": \"$figure\", \"json\": $report}")
  names+=("$name") exits+=("$status") times+=("$((SECONDS - start))") figures+=("$figure")
  write_report
}

stage venv 60 - '^Error.*' python3 -m venv "$OUT/venv"
stage install 240 - 'Successfully installed [^ ]+|^ERROR.*' \
  "$OUT/venv/bin/pip" install -e '.[gpu,profile]'
stage data 60 - 'Wrote .*' "$PY" cli.py data synth --data_dir "$DATA" --train_per_file 2000
# TF32 off: the cross-check also turns it off itself (crosscheck.py); the
# variable makes sure no library call path keeps it.
stage crosscheck 90 - '^(PASS|FAIL|Error).*' \
  env NVIDIA_TF32_OVERRIDE=0 "$PY" cli.py crosscheck --num_gpus 2 --data_dir "$DATA"
for impl in legacy modern; do
  stage "$impl" 90 - '[0-9.]+ examples/sec' \
    "$PY" cli.py "$impl" --num_gpus 2 --max_steps 300 --data_dir "$DATA" --train_dir "$OUT/$impl"
  stage "eval_$impl" 60 - 'precision @ 1 = [0-9.]+' \
    "$PY" cli.py eval --run_once --checkpoint_dir "$OUT/$impl" --data_dir "$DATA"
done
stage bench 180 "$OUT/bench.json" 'Wrote .*' \
  "$PY" cli.py bench --num_gpus 1,2 --data_dir "$DATA" --rounds 5 --warmup_rounds 2 \
  --window_steps 50 --json "$OUT/bench.json"
for impl in legacy modern; do
  stage "profile_$impl" 90 "$OUT/profile_$impl/report.json" '^step .*' \
    "$PY" cli.py profile "$impl" --num_gpus 2 --data_dir "$DATA" --out "$OUT/profile_$impl"
done

echo
printf '%-16s %6s %8s  %s\n' stage exit seconds figure
for i in "${!names[@]}"; do
  printf '%-16s %6s %8s  %s\n' "${names[$i]}" "${exits[$i]}" "${times[$i]}" "${figures[$i]}"
done
echo "Report: $OUT/gpu_check.json (logs: $OUT/logs/), ${SECONDS} s in all."
if [ -z "$DRY" ] && [ -s "$OUT/bench.json" ]; then
  echo
  "$PY" cli.py bench --from_json "$OUT/bench.json"
fi
