#!/usr/bin/env bash
# What encryption costs on a first backup: the same dataset (haulage sample-data, the
# reference 1 GiB tree of benches/compare.sh) backed up RUNS times into a fresh
# plaintext repository (format 1, --insecure-no-encryption) and RUNS times into a fresh
# encrypted one (format 2), alternating, from a hot page cache. Prints a Markdown table
# of medians of wall time, CPU seconds (user+sys) and peak RSS (/usr/bin/time -v), and
# the CPU ratio. Budget (issue 13): encrypted ≤ 1.10 × plaintext CPU.
#
# Usage: benches/encryption-cost.sh [SIZE] [RUNS] [WORKDIR]   (default 1GiB 5 /tmp/haulage-encryption)
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE="${1:-1GiB}"
RUNS="${2:-5}"
WORK="${3:-/tmp/haulage-encryption}"
export HAULAGE_PASSWORD=bench

cargo build --release --quiet --bin haulage
HAULAGE="$PWD/target/release/haulage"
mkdir -p "$WORK"
[ -d "$WORK/data" ] || "$HAULAGE" sample-data "$WORK/data" --size "$SIZE" >&2
find "$WORK/data" -type f -print0 | xargs -0 cat >/dev/null

run_once() { # format -> "wall cpu rss_kib"
    local repo="$WORK/repo" log; log=$(mktemp)
    rm -rf "$repo"
    if [ "$1" = plaintext ]; then
        "$HAULAGE" repo init --insecure-no-encryption --repo "$repo" >/dev/null
    else
        "$HAULAGE" repo init --repo "$repo" >/dev/null
    fi
    /usr/bin/time -v "$HAULAGE" backup "$WORK/data" --no-progress --repo "$repo" >/dev/null 2>"$log"
    awk -F': ' '/Elapsed \(wall clock\)/ {split($2, t, ":"); wall = (length(t) == 3) ? t[1]*3600+t[2]*60+t[3] : t[1]*60+t[2]}
                /User time|System time/ {cpu += $2}
                /Maximum resident set size/ {rss = $2}
                END {print wall, cpu, rss}' "$log"
    rm -f "$log"
}
median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

declare -A walls cpus rsss
for run in $(seq 1 "$RUNS"); do
    for format in plaintext encrypted; do
        read -r wall cpu rss < <(run_once "$format")
        walls[$format]+="$wall "; cpus[$format]+="$cpu "; rsss[$format]+="$rss "
        echo "run $run $format: wall $wall s, cpu $cpu s, rss $rss KiB" >&2
    done
done
echo "dataset: $(find "$WORK/data" -type f | wc -l) files, $(du -sh "$WORK/data" | cut -f1); $RUNS runs each, medians"
echo
echo "| format | wall s | CPU s (user+sys) | peak RSS MiB |"
echo "| --- | --- | --- | --- |"
for format in plaintext encrypted; do
    w=$(tr ' ' '\n' <<<"${walls[$format]}" | grep . | median)
    c=$(tr ' ' '\n' <<<"${cpus[$format]}" | grep . | median)
    r=$(tr ' ' '\n' <<<"${rsss[$format]}" | grep . | median)
    eval "cpu_$format=$c"
    awk -v f="$format" -v w="$w" -v c="$c" -v r="$r" 'BEGIN { printf "| %s | %.2f | %.2f | %.0f |\n", f, w, c, r/1024 }'
done
awk -v p="$cpu_plaintext" -v e="$cpu_encrypted" 'BEGIN { printf "\nCPU encrypted / plaintext: %.3f\n", e/p }'
