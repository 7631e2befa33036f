#!/usr/bin/env bash
# End-to-end comparison against a local S3 server: haulage, restic, rustic,
# kopia and rclone (raw copy, no dedup or compression) on the same generated
# dataset against the same MinIO in one run: first backup and restore. For each
# step: wall time, throughput, the client's CPU (user+sys, /usr/bin/time -v),
# the server's CPU (utime+stime from /proc/<minio pid>/stat before and after;
# the server shares the machine's cores), the GET requests the server served
# and the bytes it sent (MinIO's own counters, /minio/metrics/v3/api/requests)
# and the client's peak RSS.
# Prints a Markdown table; docs/benchmarks.md records runs.
#
# Usage: benches/compare-s3.sh [SIZE] [WORKDIR]   (default 1GiB, /tmp/haulage-compare-s3)
# RESTORE_ROOT=/dev/shm/x restores into RAM, so a busy shared disk does not
# decide the restore figures (each restore is checked and removed after it).
# Needs the MinIO binary (bash tests/infra/build.sh minio) and /usr/bin/time.
# Peers are used when on PATH (or given as RESTIC=, RUSTIC=, KOPIA=, RCLONE=);
# missing ones are reported, not faked. TOOLS="haulage restic" runs only those.
# HAULAGE=/path/to/haulage measures that binary instead of building this tree
# (to compare two builds, run the script with each in turn, interleaved).
# RESTORE_ROUNDS=7 repeats the restores of haulage and restic, interleaved.
# LATENCY_MS=10 puts benches/latency-proxy.py between the tools and MinIO,
# 10 ms each way (20 ms a round trip), as a store in another zone would be.
# TLS=1 serves HTTPS, with a CA and certificate made by openssl for the run
# (benches/minio.sh), given to haulage, restic and kopia; rustic and rclone are
# left out then (reported as such); not with LATENCY_MS.
# A WORKDIR that already holds data/ is measured as it is (e.g. the tree of
# benches/deep-tree.py) and SIZE is not used.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${TLS:-}" = 1 ] && [ -n "${LATENCY_MS:-}" ]; then
    echo "compare-s3.sh: TLS=1 and LATENCY_MS do not go together (the latency proxy speaks plain HTTP)" >&2
    exit 2
fi
SIZE="${1:-1GiB}"
WORK="${2:-/tmp/haulage-compare-s3}"
RESTIC="${RESTIC:-$(command -v restic || true)}"
RUSTIC="${RUSTIC:-$(command -v rustic || true)}"
# kopia: on PATH, $KOPIA, or the one benches/build-kopia.sh built.
KOPIA="${KOPIA:-$(command -v kopia || ls "${HAULAGE_BENCH_CACHE:-$HOME/.cache/haulage-bench}"/kopia-*/bin/kopia 2>/dev/null | tail -1 || true)}"
RCLONE="${RCLONE:-$(command -v rclone || true)}"
TOOLS="${TOOLS:-haulage restic rustic kopia rclone sizing}"
wanted() { [[ " $TOOLS " == *" $1 "* ]]; }
export RESTIC_PASSWORD=bench RUSTIC_PASSWORD=bench KOPIA_PASSWORD=bench HAULAGE_PASSWORD=bench

if [ -z "${HAULAGE:-}" ]; then
    cargo build --release --quiet --bin haulage
    HAULAGE="${CARGO_TARGET_DIR:-$PWD/target}/release/haulage"
fi
[ -x /usr/bin/time ] || { echo "compare-s3.sh: needs /usr/bin/time (apt-get install time)" >&2; exit 1; }
. benches/minio.sh
minio_binary >/dev/null

RESTORE_ROOT="${RESTORE_ROOT:-$WORK/restore}"
rm -rf "$WORK/minio" "$RESTORE_ROOT" "$WORK/state"
mkdir -p "$WORK/minio" "$RESTORE_ROOT" "$WORK/state"
if [ ! -d "$WORK/data" ]; then
    "$HAULAGE" sample-data "$WORK/data" --size "$SIZE" >&2
fi
DATA_BYTES=$(du -sb --apparent-size "$WORK/data" | cut -f1)
FILES=$(find "$WORK/data" -type f | wc -l)
find "$WORK/data" -type f -print0 | xargs -0 cat >/dev/null   # hot cache

minio_start "$WORK/minio" "$WORK/state/minio.log"
trap minio_stop EXIT
export AWS_ENDPOINT_URL=$SERVER_URL
if [ -n "${LATENCY_MS:-}" ]; then
    latency_proxy_start "$LATENCY_MS"
    PORT=$PROXY_PORT
    export AWS_ENDPOINT_URL=$PROXY_URL
fi
# rclone reaches the server through an env-configured remote named "minio".
export RCLONE_CONFIG_MINIO_TYPE=s3 RCLONE_CONFIG_MINIO_PROVIDER=Minio \
    RCLONE_CONFIG_MINIO_ENDPOINT="$AWS_ENDPOINT_URL" RCLONE_CONFIG_MINIO_REGION=us-east-1 \
    RCLONE_CONFIG_MINIO_ACCESS_KEY_ID="$AWS_ACCESS_KEY_ID" RCLONE_CONFIG_MINIO_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY"
bucket_create bench
# restic 0.14 reads no CA from the environment.
restic_tls=()
[ "${TLS:-}" != 1 ] || restic_tls=(--cacert "$MINIO_CA")

TICKS=$(getconf CLK_TCK)
server_cpu() { awk -v t="$TICKS" '{ printf "%.2f", ($14 + $15) / t }' "/proc/$MINIO_PID/stat"; }
# GET requests the server has served so far, and the bytes it has sent.
server_gets() { server_requests | awk '{ printf "%d %s", $1, $3 }'; }

# checked TOOL: the restore into $RESTORE_ROOT/TOOL has every file (content is
# the tools' business; the engine tests check haulage's); then remove it.
checked() {
    local dir="$RESTORE_ROOT/$1" found
    found=$(find "$dir" -type f 2>/dev/null | wc -l)
    [ "$found" -ge "$FILES" ] || echo "warning: $1 restored $found of $FILES files" >&2
    rm -rf "$dir"
}

# measure TOOL STEP CMD... : run once, print one table row.
measure() {
    local tool="$1" step="$2"; shift 2
    local log before after gets_before gets_after; log=$(mktemp)
    sync
    before=$(server_cpu)
    gets_before=$(server_gets)
    if ! /usr/bin/time -v "$@" >/dev/null 2>"$log"; then
        echo "| $tool | $step | failed | | | | | | | | |"; tail -5 "$log" >&2; rm -f "$log"; return
    fi
    after=$(server_cpu)
    gets_after=$(server_gets)
    read -r gets_before sent_before <<<"$gets_before"
    read -r gets_after sent_after <<<"$gets_after"
    awk -F': ' -v t="$tool" -v s="$step" -v b="$DATA_BYTES" -v sb="$before" -v sa="$after" \
        -v gb="$gets_before" -v ga="$gets_after" -v xb="$sent_before" -v xa="$sent_after" '
        /Elapsed \(wall clock\)/ { n = split($2, p, ":"); w = (n == 3) ? p[1]*3600 + p[2]*60 + p[3] : p[1]*60 + p[2] }
        /User time \(seconds\)/ { u = $2 }
        /System time \(seconds\)/ { y = $2 }
        /Maximum resident set size/ { r = $2 }
        END { gib = b / 1073741824
              printf "| %s | %s | %.2f | %.0f | %.2f | %.2f | %.2f | %d | %.0f | %.0f | %.0f |\n", t, s, w, (b/1048576)/w, u + y, sa - sb, (sa - sb) / gib, ga - gb, (ga - gb) / gib, (xa - xb) / 1048576, r/1024 }' "$log"
    rm -f "$log"
}

echo "dataset: $FILES files, $((DATA_BYTES / 1048576)) MiB; $(nproc) cores; MinIO on 127.0.0.1 (same machine)$([ "${TLS:-}" != 1 ] || echo ", over HTTPS")${LATENCY_MS:+, ${LATENCY_MS} ms each way through benches/latency-proxy.py}"
echo
echo "| tool | step | wall s | MiB/s | client CPU s | server CPU s | server CPU s/GiB | GETs | GETs/GiB | server sent MiB | client peak RSS MiB |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"

if wanted haulage; then
    "$HAULAGE" repo init --repo s3://bench/haulage >/dev/null
    measure haulage "first backup" "$HAULAGE" backup "$WORK/data" --no-progress --repo s3://bench/haulage
    measure haulage restore "$HAULAGE" restore latest "$RESTORE_ROOT/haulage" --no-progress --repo s3://bench/haulage
    checked haulage
fi

if ! wanted restic; then
    :
elif [ -n "$RESTIC" ]; then
    R="s3:$AWS_ENDPOINT_URL/bench/restic"
    "$RESTIC" "${restic_tls[@]}" init -q --repo "$R" >/dev/null
    measure restic "first backup" "$RESTIC" "${restic_tls[@]}" backup -q --repo "$R" "$WORK/data"
    measure restic restore "$RESTIC" "${restic_tls[@]}" restore -q latest --repo "$R" --target "$RESTORE_ROOT/restic"
    checked restic
else
    echo "| restic | not installed | | | | | | | | | |"
fi
if ! wanted rustic; then
    :
elif [ "${TLS:-}" = 1 ]; then
    echo "| rustic | not run with TLS=1 (no CA option wired here) | | | | | | | | | |"
elif [ -n "$RUSTIC" ]; then
    # rustic takes S3 options from a profile; -P ./NAME reads ./NAME.toml.
    cat >"$WORK/state/rustic-bench.toml" <<TOML
[repository]
repository = "opendal:s3"
password = "bench"
[repository.options]
bucket = "bench"
root = "/rustic"
endpoint = "$AWS_ENDPOINT_URL"
region = "us-east-1"
access_key_id = "$AWS_ACCESS_KEY_ID"
secret_access_key = "$AWS_SECRET_ACCESS_KEY"
TOML
    (
        cd "$WORK/state"
        RO=(-P ./rustic-bench --no-progress)
        "$RUSTIC" "${RO[@]}" init >/dev/null 2>"$WORK/state/rustic-init.log" || tail -3 "$WORK/state/rustic-init.log" >&2
        measure rustic "first backup" "$RUSTIC" "${RO[@]}" backup "$WORK/data"
        measure rustic restore "$RUSTIC" "${RO[@]}" restore latest "$RESTORE_ROOT/rustic"
    )
    checked rustic
else
    echo "| rustic | not available | | | | | | | | | |"
fi
if ! wanted kopia; then
    :
elif [ -n "$KOPIA" ]; then
    # Its cache removed with the run's state, not left in ~/.cache/kopia.
    export KOPIA_CONFIG_PATH="$WORK/state/kopia.config" KOPIA_CHECK_FOR_UPDATES=false \
        KOPIA_CACHE_DIRECTORY="$WORK/state/kopia-cache"
    if [ "${TLS:-}" = 1 ]; then kopia_tls=(--root-ca-pem-path "$MINIO_CA"); else kopia_tls=(--disable-tls); fi
    "$KOPIA" repository create s3 --bucket bench --prefix kopia/ --endpoint "127.0.0.1:$PORT" "${kopia_tls[@]}" \
        --access-key "$AWS_ACCESS_KEY_ID" --secret-access-key "$AWS_SECRET_ACCESS_KEY" >/dev/null 2>&1
    measure kopia "first backup" "$KOPIA" snapshot create "$WORK/data"
    measure kopia restore "$KOPIA" snapshot restore "$WORK/data" "$RESTORE_ROOT/kopia"
    checked kopia
else
    echo "| kopia | not available (bash benches/build-kopia.sh builds it) | | | | | | | | | |"
fi
if ! wanted rclone; then
    :
elif [ "${TLS:-}" = 1 ]; then
    echo "| rclone (raw copy) | not run with TLS=1 (no CA option wired here) | | | | | | | | | |"
elif [ -n "$RCLONE" ]; then
    measure "rclone (raw copy)" upload "$RCLONE" copy --links "$WORK/data" minio:bench/rclone
    measure "rclone (raw copy)" download "$RCLONE" copy --links minio:bench/rclone "$RESTORE_ROOT/rclone"
    checked rclone
else
    echo "| rclone | not installed | | | | | | | | | |"
fi
# RESTORE_ROUNDS=N: haulage and restic restore N - 1 more times, interleaved,
# for medians (a restore's server CPU varies by a tenth from run to run).
for round in $(seq 2 "${RESTORE_ROUNDS:-1}"); do
    if wanted haulage; then
        measure haulage "restore $round" "$HAULAGE" restore latest "$RESTORE_ROOT/haulage" --no-progress --repo s3://bench/haulage
        checked haulage
    fi
    if wanted restic && [ -n "$RESTIC" ]; then
        measure restic "restore $round" "$RESTIC" "${restic_tls[@]}" restore -q latest --repo "$R" --target "$RESTORE_ROOT/restic"
        checked restic
    fi
done
# What `haulage bench` predicts for the same data and server, to set beside the
# measured first backup above.
if wanted sizing; then
    echo
    echo '```text'
    echo "\$ haulage bench --source DATA --repo s3://bench/sizing"
    "$HAULAGE" bench --source "$WORK/data" --repo s3://bench/sizing
    echo '```'
fi
