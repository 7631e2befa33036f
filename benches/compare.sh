#!/usr/bin/env bash
# End-to-end comparison of haulage with restic, rustic and kopia on the same
# generated dataset, in one run, from a hot page cache, into local repositories:
# first backup, unchanged second backup, restore — wall time, throughput and peak
# RSS (/usr/bin/time -v). Prints a Markdown table; docs/benchmarks.md records runs.
#
# Usage: benches/compare.sh [SIZE] [WORKDIR]     (default 2GiB, /tmp/haulage-compare)
# Peers are used when on PATH: restic (Debian package), rustic (cargo install
# rustic-rs), kopia (built from its Go module). Missing peers are reported, not faked.
#
# HAULAGE=path runs that binary instead of building one; HAULAGE_BEFORE=path adds
# the rows of a second build (an A/B in the same run). RESTORE_ROOT=/dev/shm/x
# restores there instead of WORKDIR/restore: on ext4, creating the tree's files
# again shortly after the last round's restores were deleted makes the kernel scan
# for inodes not deleted recently (restores of 7-14 s with 11-18 s of system CPU on
# this project's test machine, 60 % of the samples in `recently_deleted` and its
# allocator neighbours, for every tool alike; docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE="${1:-2GiB}"
WORK="${2:-/tmp/haulage-compare}"
RESTORE="${RESTORE_ROOT:-$WORK/restore}"
export RESTIC_PASSWORD=bench RUSTIC_PASSWORD=bench KOPIA_PASSWORD=bench HAULAGE_PASSWORD=bench

if [ -z "${HAULAGE:-}" ]; then
    cargo build --release --quiet --bin haulage
    HAULAGE="${CARGO_TARGET_DIR:-$PWD/target}/release/haulage"
fi
[ -x /usr/bin/time ] || { echo "compare.sh: needs /usr/bin/time (apt-get install time)" >&2; exit 1; }

rm -rf "$WORK/repos" "$RESTORE"
mkdir -p "$WORK/repos" "$RESTORE"
if [ ! -d "$WORK/data" ]; then
    "$HAULAGE" sample-data "$WORK/data" --size "$SIZE" >&2
fi
DATA_BYTES=$(du -sb "$WORK/data" | cut -f1)
FILES=$(find "$WORK/data" -type f | wc -l)
# Hot cache: read everything once.
find "$WORK/data" -type f -print0 | xargs -0 cat >/dev/null

# checked NAME: the restore into $RESTORE/NAME has every file (content is the
# tools' business; the engine tests check haulage's). On tmpfs the restore is
# then removed: left there, each tool ran beside the restores of the tools
# before it, 2 GiB of RAM each (docs/benchmarks.md, "Side by side again,
# 2026-12-07, evening"). On a disk it stays until the next run, so that no
# tool restores into space just freed (the ext4 scan above).
restore_in_ram=false
[ "$(stat -f -c %T "$RESTORE")" = tmpfs ] && restore_in_ram=true
checked() {
    local found
    found=$(find "$RESTORE/$1" -type f 2>/dev/null | wc -l) || true
    [ "$found" -ge "$FILES" ] || echo "warning: $1 restored $found of $FILES files" >&2
    if $restore_in_ram; then rm -rf "${RESTORE:?}/$1"; fi
}

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

# haulage_rows LABEL BINARY NAME
haulage_rows() {
    "$2" repo init --repo "$WORK/repos/$3" >/dev/null
    measure "$1" "first backup" "$2" backup "$WORK/data" --no-progress --repo "$WORK/repos/$3"
    measure "$1" "second backup" "$2" backup "$WORK/data" --no-progress --repo "$WORK/repos/$3"
    measure "$1" restore "$2" restore latest "$RESTORE/$3" --no-progress --repo "$WORK/repos/$3"
    checked "$3"
}
if [ -n "${HAULAGE_BEFORE:-}" ]; then
    haulage_rows "haulage (before)" "$HAULAGE_BEFORE" haulage-before
fi
haulage_rows haulage "$HAULAGE" haulage

if command -v restic >/dev/null; then
    restic init -q --repo "$WORK/repos/restic"
    measure restic "first backup" restic backup -q --repo "$WORK/repos/restic" "$WORK/data"
    measure restic "second backup" restic backup -q --repo "$WORK/repos/restic" "$WORK/data"
    measure restic restore restic restore -q latest --repo "$WORK/repos/restic" --target "$RESTORE/restic"
    checked "restic"
else
    echo "| restic | not installed | | | | |"
fi
if command -v rustic >/dev/null; then
    rustic init --repository "$WORK/repos/rustic" >/dev/null 2>&1
    measure rustic "first backup" rustic backup --repository "$WORK/repos/rustic" "$WORK/data"
    measure rustic "second backup" rustic backup --repository "$WORK/repos/rustic" "$WORK/data"
    measure rustic restore rustic restore --repository "$WORK/repos/rustic" latest "$RESTORE/rustic"
    checked "rustic"
else
    echo "| rustic | not installed | | | | |"
fi
# kopia: on PATH, $KOPIA, or the one benches/build-kopia.sh built.
KOPIA="${KOPIA:-$(command -v kopia || ls "${HAULAGE_BENCH_CACHE:-$HOME/.cache/haulage-bench}"/kopia-*/bin/kopia 2>/dev/null | tail -1 || true)}"
if [ -n "$KOPIA" ]; then
    # Its cache beside its repository, removed with it: in ~/.cache/kopia
    # every run left a new directory of about 1.4 GiB (17 GiB after a day).
    export KOPIA_CONFIG_PATH="$WORK/repos/kopia.config" KOPIA_CHECK_FOR_UPDATES=false \
        KOPIA_CACHE_DIRECTORY="$WORK/repos/kopia-cache"
    "$KOPIA" repository create filesystem --path "$WORK/repos/kopia" >/dev/null 2>&1
    measure kopia "first backup" "$KOPIA" snapshot create "$WORK/data"
    measure kopia "second backup" "$KOPIA" snapshot create "$WORK/data"
    measure kopia restore "$KOPIA" snapshot restore "$WORK/data" "$RESTORE/kopia"
    checked "kopia"
else
    echo "| kopia | not installed (bash benches/build-kopia.sh builds it) | | | | |"
fi
