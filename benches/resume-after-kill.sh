#!/usr/bin/env bash
# An interrupted first backup, continued: each tool's first backup of the
# same generated tree is SIGKILLed part-way, then the next backup of the same
# source is timed (/usr/bin/time: wall, user, sys seconds, peak RSS KiB), and
# for haulage the bytes it read again. haulage with checkpoints every second,
# haulage without (`--checkpoint-seconds 0`: every file read again, its packs
# deduplicated), restic (no checkpoints) and kopia (its hidden
# `--checkpoint-interval 1s`). Repositories in /dev/shm, hot page cache.
#
# With SIGNAL=INT (Ctrl-C; haulage treats SIGTERM the same) the backups are
# interrupted instead of killed: haulage then stores what it read with a last
# checkpoint (run with its default `--checkpoint-seconds 60`, so that is its
# only one, and with 0), kopia saves its incomplete snapshot, restic exits.
#
# Usage: [SIGNAL=KILL|INT] benches/resume-after-kill.sh [ROUNDS] [WORKDIR]   (default KILL, 3, /tmp/haulage-compare)
# The kill comes after HAULAGE_KILL_AFTER / RESTIC_KILL_AFTER / KOPIA_KILL_AFTER
# seconds (defaults: about half of each tool's first backup of the 2 GiB sample
# tree on the two-core machine of docs/benchmarks.md; set them to half of yours).
# Peers missing from PATH (kopia: benches/build-kopia.sh) are reported, not faked.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-3}"
WORK="${2:-/tmp/haulage-compare}"
export HAULAGE_PASSWORD=bench RESTIC_PASSWORD=bench KOPIA_PASSWORD=bench
# kopia's cache is removed with its config (the glob below), not left in ~/.cache/kopia.
export KOPIA_CHECK_FOR_UPDATES=false KOPIA_CONFIG_PATH=/dev/shm/resume-kopia.config \
    KOPIA_CACHE_DIRECTORY=/dev/shm/resume-kopia.config-cache
cargo build --release --quiet --bin haulage
HAULAGE="${CARGO_TARGET_DIR:-$PWD/target}/release/haulage"
KOPIA="${KOPIA:-$(command -v kopia || ls "${HAULAGE_BENCH_CACHE:-$HOME/.cache/haulage-bench}"/kopia-*/bin/kopia 2>/dev/null | tail -1 || true)}"
[ -d "$WORK/data" ] || "$HAULAGE" sample-data "$WORK/data" --size 2GiB >&2
find "$WORK/data" -type f -print0 | xargs -0 cat >/dev/null
SIGNAL="${SIGNAL:-KILL}"
case "$SIGNAL" in KILL) EVERY="1 0" ;; *) EVERY="60 0" ;; esac
REPO=/dev/shm/resume-repo
TIMES=$(mktemp)
trap 'rm -rf "$REPO" "$TIMES" /dev/shm/resume-kopia.config*' EXIT

killed() { # AFTER CMD...: run CMD, send it SIGNAL after AFTER seconds, wait for its exit
    local after=$1; shift
    "$@" >/dev/null 2>&1 & local pid=$!
    sleep "$after"; kill -"$SIGNAL" "$pid" 2>/dev/null || echo "finished before its kill: $*" >&2
    wait "$pid" 2>/dev/null || true
}
timed() { /usr/bin/time -o "$TIMES" -f "%e %U %S %M" "$@"; }

echo "| round | tool | SIG$SIGNAL after s | next backup wall s | user s | sys s | peak RSS KiB | bytes read again |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
for round in $(seq "$ROUNDS"); do
    for every in $EVERY; do
        rm -rf "$REPO"; "$HAULAGE" repo init --repo "$REPO" >/dev/null 2>&1
        after="${HAULAGE_KILL_AFTER:-2.4}"
        killed "$after" "$HAULAGE" backup "$WORK/data" --repo "$REPO" --no-progress --checkpoint-seconds "$every"
        read_again=$(timed "$HAULAGE" backup "$WORK/data" --repo "$REPO" --no-progress --json 2>/dev/null \
            | python3 -c 'import json,sys; print(json.load(sys.stdin)["bytesRead"])')
        name="haulage --checkpoint-seconds $every"
        echo "| $round | $name | $after | $(tr ' ' '|' <"$TIMES" | sed 's/|/ | /g') | $read_again |"
    done
    if command -v restic >/dev/null; then
        rm -rf "$REPO"; restic init -q --repo "$REPO" >/dev/null 2>&1
        after="${RESTIC_KILL_AFTER:-5.4}"
        killed "$after" restic backup -q --repo "$REPO" "$WORK/data"
        restic unlock -q --repo "$REPO" >/dev/null 2>&1
        timed restic backup -q --repo "$REPO" "$WORK/data" >/dev/null 2>&1
        echo "| $round | restic | $after | $(tr ' ' '|' <"$TIMES" | sed 's/|/ | /g') | |"
    else
        echo "| $round | restic | not installed | | | | | |"
    fi
    if [ -n "$KOPIA" ]; then
        rm -rf "$REPO" /dev/shm/resume-kopia.config*
        "$KOPIA" repository create filesystem --path "$REPO" >/dev/null 2>&1
        after="${KOPIA_KILL_AFTER:-3.1}"
        # Killed: checkpoints every second; interrupted: its default
        # interval, so only what it saves when cancelled counts.
        interval=(); [ "$SIGNAL" = KILL ] && interval=(--checkpoint-interval 1s)
        killed "$after" "$KOPIA" snapshot create "$WORK/data" "${interval[@]}"
        timed "$KOPIA" snapshot create "$WORK/data" >/dev/null 2>&1
        echo "| $round | kopia | $after | $(tr ' ' '|' <"$TIMES" | sed 's/|/ | /g') | |"
    else
        echo "| $round | kopia | not installed (benches/build-kopia.sh) | | | | | |"
    fi
done
