#!/usr/bin/env bash
# Start a throwaway etcd + kube-apiserver (RBAC on, static admin token) in DIR.
#
# Usage: tests/infra/start-kube.sh DIR
#   Prints the kubeconfig path (DIR/kubeconfig) on stdout; everything else goes to
#   stderr. PIDs go to DIR/etcd.pid and DIR/kube-apiserver.pid, logs to DIR/*.log.
#   Stop with: tests/infra/stop.sh DIR
#
# Binaries: $ETCD_BIN and $KUBE_APISERVER_BIN if set, else the ones tests/infra/build.sh
# put in its cache (it is run to build them when missing).
# The admin token is in DIR/admin.token (user "haulage-admin", group system:masters).
# Extra apiserver flags can be passed in $KUBE_APISERVER_EXTRA_ARGS (word-split).
set -euo pipefail

die() { echo "start-kube.sh: error: $*" >&2; exit 1; }
log() { echo "start-kube.sh: $*" >&2; }

[[ $# -eq 1 ]] || die "usage: $0 DIR"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$1"
dir="$(cd "$1" && pwd)"
for f in etcd.pid kube-apiserver.pid; do
    [[ ! -e "$dir/$f" ]] || die "$dir/$f exists: already running? (tests/infra/stop.sh $dir)"
done
for t in openssl curl; do command -v "$t" >/dev/null || die "'$t' is not installed"; done

if [[ -z "${ETCD_BIN:-}" ]]; then ETCD_BIN="$("$here/build.sh" etcd)"; fi
if [[ -z "${KUBE_APISERVER_BIN:-}" ]]; then
    KUBE_APISERVER_BIN="$("$here/build.sh" kube)"   # kube-apiserver, then kubectl
    KUBE_APISERVER_BIN="${KUBE_APISERVER_BIN%%$'\n'*}"
fi
[[ -x "$ETCD_BIN" ]] || die "etcd binary not found: $ETCD_BIN"
[[ -x "$KUBE_APISERVER_BIN" ]] || die "kube-apiserver binary not found: $KUBE_APISERVER_BIN"

# A free TCP port on 127.0.0.1 (the kernel picks; tiny race until the server binds).
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null && return
    local p; while :; do
        p=$((20000 + RANDOM % 40000))
        [[ -z "$(ss -Htln "sport = :$p")" ]] && { echo "$p"; return; }
    done
}

started=()
fail() {
    local p; for p in "${started[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -f "$dir/etcd.pid" "$dir/kube-apiserver.pid"
    echo "start-kube.sh: error: $*" >&2
    local l; for l in "$dir"/etcd.log "$dir"/kube-apiserver.log; do
        [[ -f "$l" ]] && { echo "--- last lines of $l" >&2; tail -n 20 "$l" >&2; }
    done
    exit 1
}

# ---- certificates and credentials ---------------------------------------------------
pki="$dir/pki"
mkdir -p "$pki"
(
    cd "$pki"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
        -subj "/CN=haulage-test-ca" -keyout ca.key -out ca.crt 2>/dev/null
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -subj "/CN=kube-apiserver" -keyout apiserver.key -out apiserver.csr 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:10.0.0.1\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n' >apiserver.ext
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
        -extfile apiserver.ext -out apiserver.crt 2>/dev/null
    # service-account token signing key pair
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
) || die "generating certificates with openssl failed"
token="$(openssl rand -hex 24)"
printf '%s\n' "$token" >"$dir/admin.token"
# token,user,uid,"group1,group2"
printf '%s,haulage-admin,haulage-admin,"system:masters"\n' "$token" >"$pki/tokens.csv"
chmod 600 "$dir/admin.token" "$pki/tokens.csv" "$pki"/*.key

# ---- etcd ----------------------------------------------------------------------------
etcd_port="$(free_port)"; peer_port="$(free_port)"
while [[ "$peer_port" == "$etcd_port" ]]; do peer_port="$(free_port)"; done
etcd_url="http://127.0.0.1:$etcd_port"
etcd_healthy() { [[ "$(curl -fsS "$etcd_url/health" 2>/dev/null)" == *'"health":"true"'* ]]; }
setsid "$ETCD_BIN" --name haulage --data-dir "$dir/etcd-data" \
    --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "haulage=http://127.0.0.1:$peer_port" \
    --unsafe-no-fsync --log-level warn \
    </dev/null >"$dir/etcd.log" 2>&1 &
etcd_pid=$!
started+=("$etcd_pid")
echo "$etcd_pid" >"$dir/etcd.pid"
echo "$etcd_url" >"$dir/etcd.url"
for _ in $(seq 1 100); do
    kill -0 "$etcd_pid" 2>/dev/null || fail "etcd exited"
    etcd_healthy && break
    sleep 0.1
done
etcd_healthy || fail "etcd not healthy after 10s"
log "etcd ready at $etcd_url (pid $etcd_pid)"

# ---- kube-apiserver --------------------------------------------------------------------
api_port="$(free_port)"
server="https://127.0.0.1:$api_port"
# shellcheck disable=SC2086
setsid "$KUBE_APISERVER_BIN" \
    --etcd-servers="$etcd_url" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$api_port" \
    --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --token-auth-file="$pki/tokens.csv" \
    --authorization-mode=RBAC \
    --service-account-issuer="https://kubernetes.default.svc.cluster.local" \
    --service-account-key-file="$pki/sa.pub" \
    --service-account-signing-key-file="$pki/sa.key" \
    --api-audiences="https://kubernetes.default.svc.cluster.local" \
    --service-cluster-ip-range=10.0.0.0/24 \
    --allow-privileged=true \
    --disable-admission-plugins=ServiceAccount \
    ${KUBE_APISERVER_EXTRA_ARGS:-} \
    </dev/null >"$dir/kube-apiserver.log" 2>&1 &
api_pid=$!
started+=("$api_pid")
echo "$api_pid" >"$dir/kube-apiserver.pid"
echo "$server" >"$dir/server.url"
t0=$SECONDS
ready=
for _ in $(seq 1 600); do
    kill -0 "$api_pid" 2>/dev/null || fail "kube-apiserver exited"
    if [[ "$(curl -s --cacert "$pki/ca.crt" -H "Authorization: Bearer $token" "$server/readyz" 2>/dev/null)" == ok ]]; then
        ready=1; break
    fi
    sleep 0.2
done
[[ -n "$ready" ]] || fail "kube-apiserver not ready after 120s"
log "kube-apiserver ready at $server after $((SECONDS - t0))s (pid $api_pid)"

# ---- kubeconfig -----------------------------------------------------------------------------
cat >"$dir/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: haulage-test
  cluster:
    server: $server
    certificate-authority-data: $(base64 -w0 <"$pki/ca.crt")
users:
- name: haulage-admin
  user:
    token: $token
contexts:
- name: haulage-test
  context:
    cluster: haulage-test
    user: haulage-admin
current-context: haulage-test
EOF
chmod 600 "$dir/kubeconfig"
echo "$dir/kubeconfig"
