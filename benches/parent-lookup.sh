#!/usr/bin/env bash
# What a backup spends finding its parent in a repository that many sources
# back up into (a migration of many claims into one location): COUNT sources
# are each backed up once (a one-file directory, so each backup stores only
# its snapshot), then ROUNDS backups of sources that already have a snapshot
# are timed, each printing its wall time, peak RSS and the GETs and LISTs
# MinIO served for it (MinIO's own counters). restic (when on PATH, or
# RESTIC=) is measured the same way beside it, with --no-cache (a stage pod
# without a persistent cache) and with a warm cache.
#
# Usage: benches/parent-lookup.sh [COUNT] [WORKDIR]   (default 1000, /tmp/haulage-parent-lookup)
# HAULAGE=/path/to/haulage measures that binary instead of building this tree;
# HAULAGE_BEFORE=/path/to/another is measured beside it (interleaved).
# ROUNDS=5 timed backups of each; LATENCY_MS=10 also times them through
# benches/latency-proxy.py (10 ms each way), as a store in another zone.
# Making the sources' snapshots takes a while: about 3 minutes for 1,000 of
# haulage's and 12 for restic's on two cores (each backup of either tool
# reads the snapshots already there).
set -euo pipefail
cd "$(dirname "$0")/.."
COUNT="${1:-1000}"
WORK="${2:-/tmp/haulage-parent-lookup}"
ROUNDS="${ROUNDS:-5}"
RESTIC="${RESTIC:-$(command -v restic || true)}"
export RESTIC_PASSWORD=bench HAULAGE_PASSWORD=bench RESTIC_CACHE_DIR="$WORK/restic-cache"

if [ -z "${HAULAGE:-}" ]; then
    cargo build --release --quiet --bin haulage
    HAULAGE="${CARGO_TARGET_DIR:-$PWD/target}/release/haulage"
fi
[ -x /usr/bin/time ] || { echo "parent-lookup.sh: needs /usr/bin/time (apt-get install time)" >&2; exit 1; }
. benches/minio.sh
minio_binary >/dev/null

rm -rf "$WORK"
mkdir -p "$WORK/minio" "$WORK/source"
echo "one small file" >"$WORK/source/file"
minio_start "$WORK/minio" "$WORK/minio.log"
trap minio_stop EXIT
bucket_create bench
SERVER=$SERVER_URL
ENDPOINTS="$SERVER"
if [ -n "${LATENCY_MS:-}" ]; then
    latency_proxy_start "$LATENCY_MS"
    ENDPOINTS="$ENDPOINTS $PROXY_URL"
fi

echo "making $COUNT sources' snapshots..." >&2
export AWS_ENDPOINT_URL=$SERVER
"$HAULAGE" repo init --repo s3://bench/haulage >/dev/null
seq 1 "$COUNT" | xargs -P 2 -I{} "$HAULAGE" backup "$WORK/source" --label claim-{} --no-progress \
    --repo s3://bench/haulage >/dev/null
if [ -n "$RESTIC" ]; then
    "$RESTIC" init -q --repo "s3:$SERVER/bench/restic" >/dev/null
    seq 1 "$COUNT" | xargs -P 2 -I{} "$RESTIC" backup -q --no-cache --host claim-{} \
        --repo "s3:$SERVER/bench/restic" "$WORK/source" >/dev/null
fi

echo "| backup of a source with a snapshot, among $COUNT | wall s | peak RSS MiB | GETs | LISTs |"
echo "| --- | --- | --- | --- | --- |"
next=1
for endpoint in $ENDPOINTS; do
    export AWS_ENDPOINT_URL=$endpoint
    where=$([ "$endpoint" = "$SERVER" ] && echo "" || echo ", ${LATENCY_MS} ms each way")
    # The source's first backup by this build writes its head (a repository
    # written by an older build has none); the timed ones find it.
    for round in $(seq 1 "$ROUNDS"); do
        "$HAULAGE" backup "$WORK/source" --label "claim-$((next + round))" --no-progress \
            --repo s3://bench/haulage >/dev/null
    done
    [ -z "$RESTIC" ] || "$RESTIC" backup -q --host "claim-$next" --repo "s3:$endpoint/bench/restic" "$WORK/source" >/dev/null
    for round in $(seq 1 "$ROUNDS"); do
        source=$((next + round))
        measure_row "haulage$where" "$HAULAGE" backup "$WORK/source" --label "claim-$source" \
            --no-progress --repo s3://bench/haulage
        if [ -n "${HAULAGE_BEFORE:-}" ]; then
            measure_row "haulage before$where" "$HAULAGE_BEFORE" backup "$WORK/source" \
                --label "claim-$((source + ROUNDS))" --no-progress --repo s3://bench/haulage
        fi
        if [ -n "$RESTIC" ]; then
            measure_row "restic --no-cache$where" "$RESTIC" backup -q --no-cache --host "claim-$source" \
                --repo "s3:$endpoint/bench/restic" "$WORK/source"
            measure_row "restic, warm cache$where" "$RESTIC" backup -q --host "claim-$next" \
                --repo "s3:$endpoint/bench/restic" "$WORK/source"
        fi
    done
    next=$((next + 2 * ROUNDS + 1))
done
