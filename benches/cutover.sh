#!/usr/bin/env bash
# The cutover pass against the full restore it follows: a SIZE tree
# (`haulage sample-data`) backed up and restored into an empty directory
# (the first pass), then CHANGE_PERCENT of its files rewritten (the same
# length, new random bytes) and a few removed and added, backed up again
# (incremental) and restored with `--sync` into the first pass's directory
# (the cutover: only what differs is written, extras removed), once
# comparing every file and once with `--since` the first pass's snapshot
# (into a second copy of the first pass: only the files that changed
# between the snapshots are read). The agent's Download mode runs the same
# engine code for a VolumeRestore with `existingClaim: Sync` (with the
# claim's snapshot as `--since`). Wall time, CPU (user+sys) and peak RSS from
# /usr/bin/time -v, RUNS rounds, medians; each result is compared with the
# source tree (diff -r). Prints a Markdown table; docs/benchmarks.md records
# runs.
#
# Usage: benches/cutover.sh [SIZE] [WORKDIR]   (default 1GiB, /tmp/haulage-cutover)
# CHANGE_PERCENT (default 1), MAX_CHANGED_FILE_BYTES (default 16 MiB), RUNS (default 3), RESTORE_ROOT (default
# WORKDIR/restore; /dev/shm/... keeps a busy disk out of the figures),
# HAULAGE=/path/to/haulage measures that binary instead of building this tree.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE="${1:-1GiB}"
WORK="${2:-/tmp/haulage-cutover}"
RUNS="${RUNS:-3}"
CHANGE_PERCENT="${CHANGE_PERCENT:-1}"
MAX_CHANGED_FILE_BYTES="${MAX_CHANGED_FILE_BYTES:-$((16 << 20))}"
export HAULAGE_PASSWORD=bench
if [ -z "${HAULAGE:-}" ]; then
    cargo build --release --quiet --bin haulage
    HAULAGE="${CARGO_TARGET_DIR:-$PWD/target}/release/haulage"
fi
[ -x /usr/bin/time ] || { echo "cutover.sh: needs /usr/bin/time (apt-get install time)" >&2; exit 1; }
RESTORE_ROOT="${RESTORE_ROOT:-$WORK/restore}"

# One measured command: "wall cpu rss_kib" on stdout.
measure() {
    local log
    log=$(mktemp)
    /usr/bin/time -v "$@" >/dev/null 2>"$log" || { cat "$log" >&2; exit 1; }
    awk -F': ' '
        /Elapsed \(wall clock\)/ { n = split($2, p, ":"); w = (n == 3) ? p[1]*3600 + p[2]*60 + p[3] : p[1]*60 + p[2] }
        /User time \(seconds\)/ { u = $2 }
        /System time \(seconds\)/ { s = $2 }
        /Maximum resident set size/ { r = $2 }
        END { printf "%.2f %.2f %d\n", w, u + s, r }' "$log"
    rm -f "$log"
}

median() { sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

full_rows=()
sync_rows=()
since_rows=()
for run in $(seq 1 "$RUNS"); do
    rm -rf "$WORK" "$RESTORE_ROOT"
    mkdir -p "$WORK" "$RESTORE_ROOT"
    "$HAULAGE" sample-data "$WORK/data" --size "$SIZE" >/dev/null
    repo="$WORK/repo"
    "$HAULAGE" repo init --repo "$repo" >/dev/null
    "$HAULAGE" backup "$WORK/data" --label pass --no-progress --repo "$repo" >/dev/null
    first=$("$HAULAGE" snapshots --repo "$repo" | awk 'NR == 2 { print $1 }')
    find "$WORK/data" -type f -print0 | xargs -0 cat >/dev/null
    full_rows+=("$(measure "$HAULAGE" restore "$first" "$RESTORE_ROOT/claim" --no-progress --repo "$repo")")
    "$HAULAGE" restore "$first" "$RESTORE_ROOT/claim-since" --no-progress --repo "$repo" >/dev/null

    # The change between the passes: CHANGE_PERCENT of the files rewritten
    # in place with new bytes of the same length, one in a thousand removed,
    # as many added. The few large files (above MAX_CHANGED_FILE_BYTES) are
    # left alone, so that the share of files changed is about the share of
    # bytes changed.
    mapfile -t files < <(find "$WORK/data" -type f -size -"$((MAX_CHANGED_FILE_BYTES / 1024))"k | sort)
    total=${#files[@]}
    step=$((100 / CHANGE_PERCENT))
    changed_bytes=0
    for ((i = run; i < total; i += step)); do
        length=$(stat -c %s "${files[$i]}")
        head -c "$length" /dev/urandom >"${files[$i]}.new"
        mv "${files[$i]}.new" "${files[$i]}"
        changed_bytes=$((changed_bytes + length))
    done
    for ((i = run + 1; i < total; i += 1000)); do
        rm -f "${files[$i]}"
        head -c 4096 /dev/urandom >"${files[$i]}.added"
    done
    "$HAULAGE" backup "$WORK/data" --label pass --no-progress --repo "$repo" >/dev/null
    second=$("$HAULAGE" snapshots --repo "$repo" | awk 'NR == 3 { print $1 }')
    sync_rows+=("$(measure "$HAULAGE" restore "$second" "$RESTORE_ROOT/claim" --sync --no-progress --repo "$repo")")
    since_rows+=("$(measure "$HAULAGE" restore "$second" "$RESTORE_ROOT/claim-since" --sync --since "$first" --no-progress --repo "$repo")")
    for claim in claim claim-since; do
        diff -r "$WORK/data" "$RESTORE_ROOT/$claim" >/dev/null || { echo "cutover.sh: the synced tree $claim differs from the source" >&2; exit 1; }
    done
    echo "run $run: $total files of at most $((MAX_CHANGED_FILE_BYTES >> 20)) MiB, $((changed_bytes / 1048576)) MiB rewritten; full ${full_rows[-1]}; sync ${sync_rows[-1]}; sync --since ${since_rows[-1]}" >&2
done

column() { local n=$1; shift; printf '%s\n' "$@" | awk -v n="$n" '{ print $n }' | median; }
full_wall=$(column 1 "${full_rows[@]}")
sync_wall=$(column 1 "${sync_rows[@]}")
since_wall=$(column 1 "${since_rows[@]}")
echo "| pass | wall s (median of $RUNS) | CPU s | peak RSS MiB |"
echo "| --- | --- | --- | --- |"
mib() { awk '{ printf "%.0f", $1 / 1024 }'; }
echo "| full restore into an empty directory | $full_wall | $(column 2 "${full_rows[@]}") | $(column 3 "${full_rows[@]}" | mib) |"
echo "| cutover: restore --sync after ${CHANGE_PERCENT} % of the files changed | $sync_wall | $(column 2 "${sync_rows[@]}") | $(column 3 "${sync_rows[@]}" | mib) |"
echo "| cutover: restore --sync --since the first pass's snapshot | $since_wall | $(column 2 "${since_rows[@]}") | $(column 3 "${since_rows[@]}" | mib) |"
awk -v a="$sync_wall" -v c="$since_wall" -v b="$full_wall" 'BEGIN { printf "\ncutover / full restore: %.1f %% comparing every file, %.1f %% with --since\n", 100 * a / b, 100 * c / b }'
rm -rf "$WORK" "$RESTORE_ROOT"
