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
#
# $KUBE_ADDRESS (default 127.0.0.1): the address the apiserver binds and advertises
# (tests/infra/start-node.sh passes the host side of the node's network, so pods
# reach it). $KUBE_NODE_NAME (default empty): when set, the apiserver is set up for a
# real node of that name (tests/infra/start-node.sh): Node,RBAC authorization, the
# ServiceAccount admission plugin on (a controller-manager creates the default
# ServiceAccounts), tokens and kubeconfigs DIR/kubeconfig-{kube-controller-manager,
# kube-scheduler,kubelet,kube-proxy} for the node's components, and a client
# certificate the apiserver presents to the kubelet (logs, exec).
set -euo pipefail

die() { echo "start-kube.sh: error: $*" >&2; exit 1; }
log() { echo "start-kube.sh: $*" >&2; }

[[ $# -eq 1 ]] || die "usage: $0 DIR"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
address="${KUBE_ADDRESS:-127.0.0.1}"
node="${KUBE_NODE_NAME:-}"
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
    printf 'subjectAltName=IP:127.0.0.1,IP:%s,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:10.0.0.1\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n' "$address" >apiserver.ext
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
        -extfile apiserver.ext -out apiserver.crt 2>/dev/null
    if [[ -n "$node" ]]; then
        # what the apiserver presents to the kubelet (system:masters: logs, exec)
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
            -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" \
            -keyout kubelet-client.key -out kubelet-client.csr 2>/dev/null
        printf 'extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature\n' >kubelet-client.ext
        openssl x509 -req -in kubelet-client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
            -extfile kubelet-client.ext -out kubelet-client.crt 2>/dev/null
    fi
    # service-account token signing key pair
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
) || die "generating certificates with openssl failed"
token="$(openssl rand -hex 24)"
printf '%s\n' "$token" >"$dir/admin.token"
# token,user,uid,"group1,group2"
printf '%s,haulage-admin,haulage-admin,"system:masters"\n' "$token" >"$pki/tokens.csv"
# The node's components, each as the user its bootstrap RBAC role (for the kubelet:
# the Node authorizer) is made for.
declare -A component_tokens=()
if [[ -n "$node" ]]; then
    for c in kube-controller-manager kube-scheduler kubelet kube-proxy; do
        component_tokens[$c]="$(openssl rand -hex 24)"
    done
    {
        printf '%s,system:kube-controller-manager,system:kube-controller-manager\n' "${component_tokens[kube-controller-manager]}"
        printf '%s,system:kube-scheduler,system:kube-scheduler\n' "${component_tokens[kube-scheduler]}"
        printf '%s,system:node:%s,system:node:%s,"system:nodes"\n' "${component_tokens[kubelet]}" "$node" "$node"
        printf '%s,system:kube-proxy,system:kube-proxy\n' "${component_tokens[kube-proxy]}"
    } >>"$pki/tokens.csv"
fi
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
server="https://$address:$api_port"
if [[ -n "$node" ]]; then
    node_args=(--authorization-mode=Node,RBAC
        --kubelet-client-certificate="$pki/kubelet-client.crt"
        --kubelet-client-key="$pki/kubelet-client.key"
        --kubelet-preferred-address-types=InternalIP)
else
    # envtest's set: no controller-manager creates `default` ServiceAccounts
    node_args=(--authorization-mode=RBAC --disable-admission-plugins=ServiceAccount)
fi
# shellcheck disable=SC2086
setsid "$KUBE_APISERVER_BIN" \
    --etcd-servers="$etcd_url" \
    --bind-address="$address" --advertise-address="$address" --secure-port="$api_port" \
    --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --token-auth-file="$pki/tokens.csv" \
    "${node_args[@]}" \
    --service-account-issuer="https://kubernetes.default.svc.cluster.local" \
    --service-account-key-file="$pki/sa.pub" \
    --service-account-signing-key-file="$pki/sa.key" \
    --api-audiences="https://kubernetes.default.svc.cluster.local" \
    --service-cluster-ip-range=10.0.0.0/24 \
    --allow-privileged=true \
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

# ---- kubeconfigs -----------------------------------------------------------------------------
# write_kubeconfig FILE USER TOKEN
write_kubeconfig() {
    cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: haulage-test
  cluster:
    server: $server
    certificate-authority-data: $(base64 -w0 <"$pki/ca.crt")
users:
- name: $2
  user:
    token: $3
contexts:
- name: haulage-test
  context:
    cluster: haulage-test
    user: $2
current-context: haulage-test
EOF
    chmod 600 "$1"
}
write_kubeconfig "$dir/kubeconfig" haulage-admin "$token"
for c in "${!component_tokens[@]}"; do
    write_kubeconfig "$dir/kubeconfig-$c" "$c" "${component_tokens[$c]}"
done
echo "$dir/kubeconfig"
