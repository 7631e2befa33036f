#!/usr/bin/env bash
# Restore from a local (file://) repository, haulage against restic, runs
# interleaved (haulage, baseline, restic, haulage, ...) so that a shared
# machine's load falls on every tool alike: wall time, MiB/s, client CPU
# (user+sys) and peak RSS from /usr/bin/time -v, then the median of each.
# Prints Markdown tables; docs/benchmarks.md records runs.
#
# Usage: benches/compare-restore.sh DATA [WORKDIR]   (default /tmp/haulage-compare-restore)
# DATA is a directory to back up once per tool (`haulage sample-data DIR
# --size 2GiB`, or benches/many-small-files.py DIR). RUNS=3 restores per tool.
# RESTORE_ROOT (default WORKDIR/restore; /dev/shm/... keeps a busy disk out
# of the figures) receives each restore, which is checked for its file count
# and removed. HAULAGE=/path/to/haulage measures that binary instead of
# building this tree; HAULAGE_BASELINE=/path/to/other adds a second haulage
# (an older build) restoring the same repository. restic is used when on
# PATH (or RESTIC=); missing, it is reported, not faked.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${1:?usage: benches/compare-restore.sh DATA [WORKDIR]}"
WORK="${2:-/tmp/haulage-compare-restore}"
RUNS="${RUNS:-3}"
RESTIC="${RESTIC:-$(command -v restic || true)}"
export RESTIC_PASSWORD=bench HAULAGE_PASSWORD=bench   # every tool encrypts its repository
if [ -z "${HAULAGE:-}" ]; then
    cargo build --release --quiet --bin haulage
    HAULAGE="${CARGO_TARGET_DIR:-$PWD/target}/release/haulage"
fi
[ -x /usr/bin/time ] || { echo "compare-restore.sh: needs /usr/bin/time (apt-get install time)" >&2; exit 1; }
RESTORE_ROOT="${RESTORE_ROOT:-$WORK/restore}"
rm -rf "$WORK/repos" "$RESTORE_ROOT"
mkdir -p "$WORK/repos" "$RESTORE_ROOT"
DATA_BYTES=$(du -sb --apparent-size "$DATA" | cut -f1)
FILES=$(find "$DATA" -type f | wc -l)
find "$DATA" -type f -print0 | xargs -0 cat >/dev/null   # hot cache

"$HAULAGE" repo init --repo "$WORK/repos/haulage" >/dev/null
"$HAULAGE" backup "$DATA" --no-progress --repo "$WORK/repos/haulage" >/dev/null
SNAPSHOT=$("$HAULAGE" snapshots --repo "$WORK/repos/haulage" | awk 'NR == 2 { print $1 }')
if [ -n "$RESTIC" ]; then
    "$RESTIC" init -q --repo "$WORK/repos/restic" >/dev/null
    "$RESTIC" backup -q --repo "$WORK/repos/restic" "$DATA" >/dev/null
fi

ROWS=$(mktemp)
# measure TOOL CMD... : one restore into $RESTORE_ROOT/TOOL, one row.
measure() {
    local tool="$1"; shift
    local log found; log=$(mktemp)
    sync
    if ! /usr/bin/time -v "$@" >/dev/null 2>"$log"; then
        echo "| $tool | failed | | | | |"; tail -5 "$log" >&2; rm -f "$log"; return
    fi
    found=$(find "$RESTORE_ROOT/$tool" -type f | wc -l)
    [ "$found" -ge "$FILES" ] || echo "warning: $tool restored $found of $FILES files" >&2
    rm -rf "${RESTORE_ROOT:?}/$tool"
    awk -F': ' -v t="$tool" -v b="$DATA_BYTES" '
        /Elapsed \(wall clock\)/ { n = split($2, p, ":"); w = (n == 3) ? p[1]*3600 + p[2]*60 + p[3] : p[1]*60 + p[2] }
        /User time \(seconds\)/ { u = $2 }
        /System time \(seconds\)/ { y = $2 }
        /Maximum resident set size/ { r = $2 }
        END { printf "| %s | %.2f | %.0f | %.2f | %.0f |\n", t, w, (b/1048576)/w, u + y, r/1024 }' "$log" | tee -a "$ROWS"
    rm -f "$log"
}

echo "dataset: $FILES files, $((DATA_BYTES / 1048576)) MiB; $(nproc) cores; load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| tool | wall s | MiB/s | CPU s (user+sys) | peak RSS MiB |"
echo "| --- | --- | --- | --- | --- |"
for _ in $(seq "$RUNS"); do
    measure haulage "$HAULAGE" restore "$SNAPSHOT" "$RESTORE_ROOT/haulage" --no-progress --repo "$WORK/repos/haulage"
    if [ -n "${HAULAGE_BASELINE:-}" ]; then
        measure baseline "$HAULAGE_BASELINE" restore "$SNAPSHOT" "$RESTORE_ROOT/baseline" --no-progress --repo "$WORK/repos/haulage"
    fi
    if [ -n "$RESTIC" ]; then
        measure restic "$RESTIC" restore -q latest --repo "$WORK/repos/restic" --target "$RESTORE_ROOT/restic"
    fi
done
[ -n "$RESTIC" ] || echo "| restic | not installed | | | |"
echo
echo "medians of $RUNS runs (load after: $(cut -d' ' -f1-3 /proc/loadavg)):"
echo
echo "| tool | wall s | MiB/s | CPU s (user+sys) | peak RSS MiB |"
echo "| --- | --- | --- | --- | --- |"
for tool in haulage baseline restic; do
    grep "^| $tool |" "$ROWS" >/dev/null || continue
    for column in 3 4 5 6; do
        grep "^| $tool |" "$ROWS" | awk -F'|' -v c="$column" '{ print $c + 0 }' | sort -n |
            awk '{ v[NR] = $1 } END { printf "%s ", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
    done | awk -v t="$tool" '{ printf "| %s | %.2f | %.0f | %.2f | %.0f |\n", t, $1, $2, $3, $4 }'
done
rm -f "$ROWS"
