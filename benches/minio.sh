# Sourced by the benches that run against a MinIO of their own
# (compare-s3.sh, parent-lookup.sh, index-gathering.sh): the server on a free
# port of 127.0.0.1, the latency proxy in front of it, the bucket, and the
# server's own request counters. Needs MinIO (bash tests/infra/build.sh minio).

MINIO_PID=
PROXY_PID=

# A free TCP port of 127.0.0.1.
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# The MinIO binary tests/infra/build.sh built; exits saying how to build it.
minio_binary() {
    local minio
    minio=$(ls -d "$HOME"/.cache/haulage-infra/minio-*/bin/minio 2>/dev/null | tail -1)
    [ -x "$minio" ] || { echo "$0: no MinIO; run: bash tests/infra/build.sh minio" >&2; exit 1; }
    echo "$minio"
}

# tls_certificates DIR: a CA and a certificate for 127.0.0.1 that it issued,
# made with openssl: DIR/public.crt and DIR/private.key as MinIO reads them
# (--certs-dir), DIR/ca.crt for the clients.
tls_certificates() {
    command -v openssl >/dev/null || { echo "$0: TLS=1 needs openssl (apt-get install openssl)" >&2; exit 1; }
    mkdir -p "$1"
    # Each step's messages go to DIR/openssl.log, shown if one fails.
    {
        openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=haulage bench CA" \
            -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign" \
            -keyout "$1/ca.key" -out "$1/ca.crt" &&
        openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
            -keyout "$1/private.key" -out "$1/leaf.csr" &&
        printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' >"$1/leaf.ext" &&
        openssl x509 -req -in "$1/leaf.csr" -CA "$1/ca.crt" -CAkey "$1/ca.key" -CAcreateserial \
            -days 2 -extfile "$1/leaf.ext" -out "$1/public.crt"
    } >"$1/openssl.log" 2>&1 || { echo "$0: cannot make the TLS certificates:" >&2; cat "$1/openssl.log" >&2; exit 1; }
}

# minio_start DATA_DIR LOG: start MinIO with the benches' credentials (exported
# as AWS_*) and wait until it is ready. Sets PORT, SERVER_URL and MINIO_PID;
# minio_stop ends it. Plain HTTP (a CA bundle from the environment only trips
# rclone), or with TLS=1 HTTPS with a certificate made by tls_certificates in
# DATA_DIR.certs, whose CA is exported as MINIO_CA and to the clients that
# read it from the environment: AWS_CA_BUNDLE (haulage), CURL_CA_BUNDLE (curl);
# restic takes it as --cacert "$MINIO_CA", kopia as --root-ca-pem-path.
minio_start() {
    local minio scheme=http
    local -a certs=()
    minio=$(minio_binary)
    unset AWS_CA_BUNDLE
    if [ "${TLS:-}" = 1 ]; then
        rm -rf "$1.certs"
        tls_certificates "$1.certs"
        export MINIO_CA="$1.certs/ca.crt"
        export AWS_CA_BUNDLE=$MINIO_CA CURL_CA_BUNDLE=$MINIO_CA
        scheme=https
        certs=(--certs-dir "$1.certs")
    fi
    export AWS_ACCESS_KEY_ID=haulage-bench AWS_SECRET_ACCESS_KEY=haulage-bench-secret AWS_REGION=us-east-1
    PORT=$(free_port)
    SERVER_URL="$scheme://127.0.0.1:$PORT"
    MINIO_ROOT_USER=$AWS_ACCESS_KEY_ID MINIO_ROOT_PASSWORD=$AWS_SECRET_ACCESS_KEY MINIO_BROWSER=off MINIO_UPDATE=off \
        MINIO_PROMETHEUS_AUTH_TYPE=public \
        "$minio" server --quiet --address "127.0.0.1:$PORT" --console-address "127.0.0.1:$(free_port)" \
        "${certs[@]}" "$1" >"$2" 2>&1 &
    MINIO_PID=$!
    # A cold start (binary and data not in the page cache) can take over 10 s.
    for _ in $(seq 600); do
        curl -sf "$SERVER_URL/minio/health/ready" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "$0: MinIO was not ready within 60 s; its log:" >&2
    tail -20 "$2" >&2
    exit 1
}

# latency_proxy_start MS: benches/latency-proxy.py in front of the server,
# MS each way (a store in another zone). Sets PROXY_PORT, PROXY_URL, PROXY_PID.
latency_proxy_start() {
    PROXY_PORT=$(free_port)
    PROXY_URL="http://127.0.0.1:$PROXY_PORT"
    python3 benches/latency-proxy.py "$PROXY_PORT" "$PORT" "$1" &
    PROXY_PID=$!
    for _ in $(seq 100); do
        curl -sf "$PROXY_URL/minio/health/ready" >/dev/null 2>&1 && break
        sleep 0.1
    done
}

# End the server and the proxy (the scripts' EXIT trap).
minio_stop() {
    # shellcheck disable=SC2086
    kill $MINIO_PID $PROXY_PID 2>/dev/null || true
    [ -z "$MINIO_PID" ] || wait "$MINIO_PID" 2>/dev/null || true
}

# bucket_create NAME: the bucket on the server.
bucket_create() {
    curl -sf --aws-sigv4 "aws:amz:us-east-1:s3" --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" \
        -X PUT "$SERVER_URL/$1" >/dev/null || { echo "$0: cannot create the bucket $1" >&2; exit 1; }
}

# The GetObject and ListObjectsV2 requests the server has served so far and
# the bytes it has sent: "GETS LISTS BYTES" (the v3 metrics are not cached,
# unlike v2's, so a reading right after a step counts all of its requests;
# %.0f: awk's %d stops at 2^31 - 1).
server_requests() {
    curl -sf "$SERVER_URL/minio/metrics/v3/api/requests" |
        awk '/^minio_api_requests_total\{/ && /name="GetObject"/ { g += $NF }
             /^minio_api_requests_total\{/ && /name="ListObjectsV2"/ { l += $NF }
             /^minio_api_requests_traffic_sent_bytes\{/ { b += $NF }
             END { printf "%d %d %.0f\n", g, l, b }'
}

# measure_row NAME COMMAND...: run COMMAND once (its output in $WORK/out, shown
# if it fails) and print one table row: NAME, wall s, peak RSS MiB, and the
# GETs and LISTs the server served meanwhile.
measure_row() {
    local name=$1 g0 l0 g1 l1 wall rss
    shift
    read -r g0 l0 _ < <(server_requests)
    /usr/bin/time -f "%e %M" -o "$WORK/time" "$@" >"$WORK/out" 2>&1 || { cat "$WORK/out" >&2; exit 1; }
    read -r g1 l1 _ < <(server_requests)
    read -r wall rss <"$WORK/time"
    printf '| %s | %s | %s | %d | %d |\n' "$name" "$wall" "$((rss / 1024))" "$((g1 - g0))" "$((l1 - l0))"
}
