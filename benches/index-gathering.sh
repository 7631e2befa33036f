#!/usr/bin/env bash
# What the index files of many backups cost the next backup, and what
# prune's gathering of them gives back: COUNT claims (a directory of one
# distinct 64 KiB file each) are backed up once into one location on MinIO,
# each backup writing index files of its own; then ROUNDS backups of a claim
# are timed, `haulage prune` gathers the index files, and ROUNDS backups are
# timed again. Each timed line: wall time, peak RSS, and the GETs and LISTs
# MinIO served for it (MinIO's own counters).
#
# Usage: benches/index-gathering.sh [COUNT] [WORKDIR]   (default 1000, /tmp/haulage-index-gathering)
# HAULAGE=/path/to/haulage measures that binary instead of building this tree.
# ROUNDS=5; LATENCY_MS=10 puts benches/latency-proxy.py (10 ms each way)
# between haulage and MinIO for the timed runs.
set -euo pipefail
cd "$(dirname "$0")/.."
COUNT="${1:-1000}"
WORK="${2:-/tmp/haulage-index-gathering}"
ROUNDS="${ROUNDS:-5}"
export HAULAGE_PASSWORD=bench

if [ -z "${HAULAGE:-}" ]; then
    cargo build --release --quiet --bin haulage
    HAULAGE="${CARGO_TARGET_DIR:-$PWD/target}/release/haulage"
fi
[ -x /usr/bin/time ] || { echo "index-gathering.sh: needs /usr/bin/time (apt-get install time)" >&2; exit 1; }
. benches/minio.sh
minio_binary >/dev/null

rm -rf "$WORK"
mkdir -p "$WORK/minio" "$WORK/claims"
python3 - "$WORK/claims" "$COUNT" <<'PY'
import os, random, sys
root, count = sys.argv[1], int(sys.argv[2])
for claim in range(1, count + 1):
    os.makedirs(f"{root}/claim-{claim}")
    with open(f"{root}/claim-{claim}/data", "wb") as out:
        out.write(random.Random(claim).randbytes(64 * 1024))
PY
minio_start "$WORK/minio" "$WORK/minio.log"
trap minio_stop EXIT
bucket_create bench
SERVER=$SERVER_URL
ENDPOINT=$SERVER
WHERE=""
if [ -n "${LATENCY_MS:-}" ]; then
    latency_proxy_start "$LATENCY_MS"
    ENDPOINT=$PROXY_URL
    WHERE=", ${LATENCY_MS} ms each way"
fi

index_files() { find "$WORK/minio/bench/haulage/index" -mindepth 1 -maxdepth 1 | wc -l; }

echo "backing up $COUNT claims..." >&2
export AWS_ENDPOINT_URL=$SERVER
"$HAULAGE" repo init --repo s3://bench/haulage >/dev/null
seq 1 "$COUNT" | xargs -P 2 -I{} "$HAULAGE" backup "$WORK/claims/claim-{}" --label claim-{} --no-progress \
    --repo s3://bench/haulage >/dev/null

export AWS_ENDPOINT_URL=$ENDPOINT
echo "| step, $COUNT claims in the location$WHERE | wall s | peak RSS MiB | GETs | LISTs |"
echo "| --- | --- | --- | --- | --- |"
before=$(index_files)
for round in $(seq 1 "$ROUNDS"); do
    measure_row "backup of a claim, $before index files" "$HAULAGE" backup "$WORK/claims/claim-$round" \
        --label "claim-$round" --no-progress --repo s3://bench/haulage
done
measure_row "prune" "$HAULAGE" prune --repo s3://bench/haulage
grep "index files" "$WORK/out" >&2 || true
after=$(index_files)
for round in $(seq 1 "$ROUNDS"); do
    measure_row "backup of a claim, $after index files" "$HAULAGE" backup "$WORK/claims/claim-$round" \
        --label "claim-$round" --no-progress --repo s3://bench/haulage
done
