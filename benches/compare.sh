#!/usr/bin/env bash
# End-to-end comparison of haulage with restic, rustic and kopia on the same
# generated dataset, in one run, from a hot page cache, into local repositories:
# first backup, unchanged second backup, restore — wall time, throughput and peak
# RSS (/usr/bin/time -v). Prints a Markdown table; docs/benchmarks.md records runs.
#
# Usage: benches/compare.sh [SIZE] [WORKDIR]     (default 2GiB, /tmp/haulage-compare)
# Peers are used when on PATH: restic (Debian package), rustic (cargo install
# rustic-rs), kopia (built from its Go module). Missing peers are reported, not faked.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE="${1:-2GiB}"
WORK="${2:-/tmp/haulage-compare}"
export RESTIC_PASSWORD=bench RUSTIC_PASSWORD=bench KOPIA_PASSWORD=bench HAULAGE_PASSWORD=bench

cargo build --release --quiet --bin haulage
HAULAGE="${CARGO_TARGET_DIR:-$PWD/target}/release/haulage"
[ -x /usr/bin/time ] || { echo "compare.sh: needs /usr/bin/time (apt-get install time)" >&2; exit 1; }

rm -rf "$WORK/repos" "$WORK/restore"
mkdir -p "$WORK/repos" "$WORK/restore"
if [ ! -d "$WORK/data" ]; then
    "$HAULAGE" sample-data "$WORK/data" --size "$SIZE" >&2
fi
DATA_BYTES=$(du -sb "$WORK/data" | cut -f1)
FILES=$(find "$WORK/data" -type f | wc -l)
# Hot cache: read everything once.
find "$WORK/data" -type f -print0 | xargs -0 cat >/dev/null

# measure LABEL CMD... : run, print "| tool | step | s | MiB/s | peak RSS MiB |"
measure() {
    local tool="$1" step="$2"; shift 2
    local log; log=$(mktemp)
    # What earlier steps left dirty (the last tool's restore, the last
    # round's files) is written back first, so no tool's time includes
    # another's writes; a tool's own writes and fsyncs stay in its time.
    sync
    if ! /usr/bin/time -v "$@" >/dev/null 2>"$log"; then
        echo "| $tool | $step | failed | | | |"; tail -5 "$log" >&2; rm -f "$log"; return
    fi
    local wall rss cpu
    wall=$(awk -F': ' '/Elapsed \(wall clock\)/ {print $2}' "$log" | awk -F: '{ if (NF==3) print $1*3600+$2*60+$3; else print $1*60+$2 }')
    rss=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$log")
    cpu=$(awk -F': ' '/User time|System time/ {sum += $2} END {print sum}' "$log")
    awk -v t="$tool" -v s="$step" -v w="$wall" -v b="$DATA_BYTES" -v r="$rss" -v c="$cpu" \
        'BEGIN { printf "| %s | %s | %.2f | %.0f | %.2f | %.0f |\n", t, s, w, (b/1048576)/w, c, r/1024 }'
    rm -f "$log"
}

echo "dataset: $FILES files, $((DATA_BYTES / 1048576)) MiB, $(nproc) cores"
echo
echo "| tool | step | wall s | MiB/s | CPU s (user+sys) | peak RSS MiB |"
echo "| --- | --- | --- | --- | --- | --- |"

"$HAULAGE" repo init --repo "$WORK/repos/haulage" >/dev/null
measure haulage "first backup" "$HAULAGE" backup "$WORK/data" --no-progress --repo "$WORK/repos/haulage"
measure haulage "second backup" "$HAULAGE" backup "$WORK/data" --no-progress --repo "$WORK/repos/haulage"
measure haulage restore "$HAULAGE" restore latest "$WORK/restore/haulage" --no-progress --repo "$WORK/repos/haulage"

if command -v restic >/dev/null; then
    restic init -q --repo "$WORK/repos/restic"
    measure restic "first backup" restic backup -q --repo "$WORK/repos/restic" "$WORK/data"
    measure restic "second backup" restic backup -q --repo "$WORK/repos/restic" "$WORK/data"
    measure restic restore restic restore -q latest --repo "$WORK/repos/restic" --target "$WORK/restore/restic"
else
    echo "| restic | not installed | | | | |"
fi
if command -v rustic >/dev/null; then
    rustic init --repository "$WORK/repos/rustic" >/dev/null 2>&1
    measure rustic "first backup" rustic backup --repository "$WORK/repos/rustic" "$WORK/data"
    measure rustic "second backup" rustic backup --repository "$WORK/repos/rustic" "$WORK/data"
    measure rustic restore rustic restore --repository "$WORK/repos/rustic" latest "$WORK/restore/rustic"
else
    echo "| rustic | not installed | | | | |"
fi
# kopia: on PATH, $KOPIA, or the one benches/build-kopia.sh built.
KOPIA="${KOPIA:-$(command -v kopia || ls "${HAULAGE_BENCH_CACHE:-$HOME/.cache/haulage-bench}"/kopia-*/bin/kopia 2>/dev/null | tail -1 || true)}"
if [ -n "$KOPIA" ]; then
    export KOPIA_CONFIG_PATH="$WORK/repos/kopia.config" KOPIA_CHECK_FOR_UPDATES=false
    "$KOPIA" repository create filesystem --path "$WORK/repos/kopia" >/dev/null 2>&1
    measure kopia "first backup" "$KOPIA" snapshot create "$WORK/data"
    measure kopia "second backup" "$KOPIA" snapshot create "$WORK/data"
    measure kopia restore "$KOPIA" snapshot restore "$WORK/data" "$WORK/restore/kopia"
else
    echo "| kopia | not installed (bash benches/build-kopia.sh builds it) | | | | |"
fi
