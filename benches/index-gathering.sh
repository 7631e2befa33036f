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
MINIO=$(ls -d "$HOME"/.cache/haulage-infra/minio-*/bin/minio 2>/dev/null | tail -1)
[ -x "$MINIO" ] || { echo "index-gathering.sh: no MinIO; run: bash tests/infra/build.sh minio" >&2; exit 1; }

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
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free_port)
unset AWS_CA_BUNDLE
export AWS_ACCESS_KEY_ID=haulage-bench AWS_SECRET_ACCESS_KEY=haulage-bench-secret AWS_REGION=us-east-1
SERVER="http://127.0.0.1:$PORT"
MINIO_ROOT_USER=$AWS_ACCESS_KEY_ID MINIO_ROOT_PASSWORD=$AWS_SECRET_ACCESS_KEY MINIO_BROWSER=off MINIO_UPDATE=off \
    MINIO_PROMETHEUS_AUTH_TYPE=public \
    "$MINIO" server --quiet --address "127.0.0.1:$PORT" --console-address "127.0.0.1:$(free_port)" "$WORK/minio" \
    >"$WORK/minio.log" 2>&1 &
PIDS=$!
trap 'kill $PIDS 2>/dev/null || true' EXIT
for _ in $(seq 1 60); do curl -sf "$SERVER/minio/health/ready" >/dev/null 2>&1 && break; sleep 1; done
curl -sf --aws-sigv4 "aws:amz:us-east-1:s3" --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" \
    -X PUT "$SERVER/bench" >/dev/null || { echo "index-gathering.sh: cannot create the bucket" >&2; exit 1; }
ENDPOINT=$SERVER
WHERE=""
if [ -n "${LATENCY_MS:-}" ]; then
    PROXY_PORT=$(free_port)
    python3 benches/latency-proxy.py "$PROXY_PORT" "$PORT" "$LATENCY_MS" &
    PIDS="$PIDS $!"
    ENDPOINT="http://127.0.0.1:$PROXY_PORT"
    WHERE=", ${LATENCY_MS} ms each way"
fi

counts() {
    curl -sf "$SERVER/minio/metrics/v3/api/requests" | awk '
        /^minio_api_requests_total\{/ && /name="GetObject"/ { g += $NF }
        /^minio_api_requests_total\{/ && /name="ListObjectsV2"/ { l += $NF }
        END { print g + 0, l + 0 }'
}
measure() {
    local name=$1 g0 l0 g1 l1
    shift
    read -r g0 l0 < <(counts)
    /usr/bin/time -f "%e %M" -o "$WORK/time" "$@" >"$WORK/out" 2>&1 || { cat "$WORK/out" >&2; exit 1; }
    read -r g1 l1 < <(counts)
    read -r wall rss <"$WORK/time"
    printf '| %s | %s | %s | %d | %d |\n' "$name" "$wall" "$((rss / 1024))" "$((g1 - g0))" "$((l1 - l0))"
}
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
    measure "backup of a claim, $before index files" "$HAULAGE" backup "$WORK/claims/claim-$round" \
        --label "claim-$round" --no-progress --repo s3://bench/haulage
done
measure "prune" "$HAULAGE" prune --repo s3://bench/haulage
grep "index files" "$WORK/out" >&2 || true
after=$(index_files)
for round in $(seq 1 "$ROUNDS"); do
    measure "backup of a claim, $after index files" "$HAULAGE" backup "$WORK/claims/claim-$round" \
        --label "claim-$round" --no-progress --repo s3://bench/haulage
done
