#!/usr/bin/env bash
# Recipe search for the bundled judge: several scripts/train_judge.py settings at once (one
# process each, e.g. on a GPU machine: DEVICE=cuda), a log per setting in $OUT/<name>.log.
# The shipped weights come from a CPU run of scripts/train_judge.py with its defaults, not
# from here.
#   OUT=/tmp/sweep DEVICE=cpu LIMIT_S=60 scripts/sweep_judge.sh "a --steps 2" "b --steps 2 --lr 1e-2"
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
for setting in "$@"; do
  name=${setting%% *}
  args=${setting#"$name"}
  # shellcheck disable=SC2086
  PYTHONPATH=. timeout "${LIMIT_S:-300}" "$PYTHON" scripts/train_judge.py --device "${DEVICE:-cpu}" \
    --out "$OUT/weights_$name" $args >"$OUT/$name.log" 2>&1 &
done
wait
rm -rf "$OUT"/weights_*
tail -n 3 "$OUT"/*.log
