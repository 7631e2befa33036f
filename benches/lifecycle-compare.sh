#!/usr/bin/env bash
# forget and prune of haulage beside restic (and rustic, when on PATH) on the same
# generated history: SNAPSHOTS backups of a changing tree (the sample tree of
# `haulage sample-data`; each round rewrites a tenth of the small files and 16 MiB of
# the large random file), then `forget --keep-last KEEP` and `prune`, each RUNS times
# from a copy of the same repository. Prints a Markdown table of medians: wall time,
# CPU seconds, peak RSS (/usr/bin/time -v) and bytes reclaimed (du -sb before/after).
#
# Usage: benches/lifecycle-compare.sh [SIZE] [SNAPSHOTS] [KEEP] [RUNS] [WORKDIR]
#        (defaults 1GiB 20 5 3 /tmp/haulage-lifecycle)
# Each prune deletes in the same run: haulage with --safety-margin 0s (its default 24h
# margin only marks on a first run), rustic with --instant-delete (its default
# --keep-delete 23h likewise only marks), restic as it does by default; otherwise each
# with its defaults (haulage: 10% repack threshold; restic and rustic: --max-unused 5%).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE="${1:-1GiB}"
SNAPSHOTS="${2:-20}"
KEEP="${3:-5}"
RUNS="${4:-3}"
WORK="${5:-/tmp/haulage-lifecycle}"
export HAULAGE_PASSWORD=bench RESTIC_PASSWORD=bench RUSTIC_PASSWORD=bench

cargo build --release --quiet --bin haulage
HAULAGE="${CARGO_TARGET_DIR:-$PWD/target}/release/haulage"
[ -x /usr/bin/time ] || { echo "needs /usr/bin/time (apt-get install time)" >&2; exit 1; }

rm -rf "$WORK"
mkdir -p "$WORK/repos"
"$HAULAGE" sample-data "$WORK/data" --size "$SIZE" >&2
DATA="$WORK/data"

tools=(haulage restic)
command -v rustic >/dev/null && tools+=(rustic)

init() {
    case "$1" in
        haulage) "$HAULAGE" repo init --repo "$WORK/repos/haulage" >/dev/null ;;
        restic) restic init -q --repo "$WORK/repos/restic" ;;
        rustic) rustic init --repository "$WORK/repos/rustic" >/dev/null 2>&1 ;;
    esac
}
backup() {
    case "$1" in
        haulage) "$HAULAGE" backup "$DATA" --no-progress --repo "$WORK/repos/haulage" >/dev/null ;;
        restic) restic backup -q --repo "$WORK/repos/restic" "$DATA" >/dev/null ;;
        rustic) rustic backup --repository "$WORK/repos/rustic" "$DATA" >/dev/null 2>&1 ;;
    esac
}
# command_of TOOL STEP REPO: the step's command line into CMD.
command_of() {
    case "$1:$2" in
        haulage:forget) CMD=("$HAULAGE" forget --keep-last "$KEEP" --repo "$3") ;;
        haulage:prune) CMD=("$HAULAGE" prune --safety-margin 0s --repo "$3") ;;
        restic:forget) CMD=(restic forget -q --keep-last "$KEEP" --repo "$3") ;;
        restic:prune) CMD=(restic prune -q --repo "$3") ;;
        rustic:forget) CMD=(rustic forget --keep-last "$KEEP" --repository "$3") ;;
        rustic:prune) CMD=(rustic prune --instant-delete --repository "$3") ;;
    esac
}

for tool in "${tools[@]}"; do init "$tool"; done
small=( $(find "$DATA/small" -type f | sort) )
for round in $(seq 1 "$SNAPSHOTS"); do
    # A tenth of the small files, and 16 MiB of the large random file, change.
    for ((i = round % 10; i < ${#small[@]}; i += 10)); do
        head -c "$(stat -c %s "${small[$i]}")" /dev/urandom > "${small[$i]}"
    done
    dd if=/dev/urandom of="$DATA/large/random.bin" bs=1M count=16 \
        seek=$(( (round * 16) % 200 )) conv=notrunc status=none
    for tool in "${tools[@]}"; do backup "$tool"; done
done

# measure CMD...: prints "wall cpu rss_kib"
measure() {
    local log; log=$(mktemp)
    /usr/bin/time -v "$@" >/dev/null 2>"$log" || { tail -5 "$log" >&2; rm -f "$log"; echo "fail fail fail"; return; }
    local wall rss cpu
    wall=$(awk -F': ' '/Elapsed \(wall clock\)/ {print $2}' "$log" | awk -F: '{ if (NF==3) print $1*3600+$2*60+$3; else print $1*60+$2 }')
    rss=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$log")
    cpu=$(awk -F': ' '/User time|System time/ {sum += $2} END {print sum}' "$log")
    rm -f "$log"
    echo "$wall $cpu $rss"
}
median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

echo "history: $SNAPSHOTS snapshots of $(du -sh "$DATA" | cut -f1) ($(find "$DATA" -type f | wc -l) files), forget --keep-last $KEEP, $RUNS runs each, medians"
echo
echo "| tool | step | wall s | CPU s | peak RSS MiB | repository before | after | reclaimed |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
for tool in "${tools[@]}"; do
    for step in forget prune; do
        walls=(); cpus=(); rsss=(); befores=(); afters=()
        for run in $(seq 1 "$RUNS"); do
            copy="$WORK/repos/$tool-run"
            rm -rf "$copy"; cp -a "$WORK/repos/$tool" "$copy"
            if [ "$step" = prune ]; then
                command_of "$tool" forget "$copy"; "${CMD[@]}" >/dev/null 2>&1
            fi
            before=$(du -sb "$copy" | cut -f1)
            command_of "$tool" "$step" "$copy"
            read -r wall cpu rss < <(measure "${CMD[@]}")
            after=$(du -sb "$copy" | cut -f1)
            walls+=("$wall"); cpus+=("$cpu"); rsss+=("$rss"); befores+=("$before"); afters+=("$after")
        done
        w=$(printf '%s\n' "${walls[@]}" | median)
        c=$(printf '%s\n' "${cpus[@]}" | median)
        r=$(printf '%s\n' "${rsss[@]}" | median)
        b=$(printf '%s\n' "${befores[@]}" | median)
        a=$(printf '%s\n' "${afters[@]}" | median)
        awk -v t="$tool" -v s="$step" -v w="$w" -v c="$c" -v r="$r" -v b="$b" -v a="$a" \
            'BEGIN { printf "| %s | %s | %.2f | %.2f | %.0f | %.1f MiB | %.1f MiB | %.1f MiB |\n", t, s, w, c, r/1024, b/1048576, a/1048576, (b-a)/1048576 }'
    done
    rm -rf "$WORK/repos/$tool-run"
done
command -v rustic >/dev/null || echo "| rustic | not on PATH | | | | | | |"
