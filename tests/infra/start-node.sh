#!/usr/bin/env bash
# Start a real one-node Kubernetes cluster in DIR: etcd and kube-apiserver (through
# start-kube.sh), kube-controller-manager, kube-scheduler, and a node with
# containerd + runc (Debian's packages), the kubelet, kube-proxy (iptables mode) and
# the standard CNI bridge plugin, every part from the same pinned Kubernetes modules
# (tests/infra/build.sh kube node). Root only.
#
# Usage: tests/infra/start-node.sh DIR [--watch PID] [--image ARCHIVE]...
#   --image ARCHIVE  a docker-archive to import into the node's containerd (e.g. from
#                    tests/infra/build-images.sh); the sandbox (pause) image is built
#                    and imported always.
#   --watch PID      stop everything (tests/infra/stop.sh DIR) and remove DIR once PID
#                    has exited: a test binary that shares one node between its tests
#                    passes its own PID. What stop.sh could not clean up is left in
#                    DIR.stop.log.
# Prints the admin kubeconfig (DIR/kubeconfig) on stdout, progress on stderr. DIR/node.env
# holds what a test needs (node name, addresses, containerd socket, cgroup root, the
# directory for local volumes and their StorageClass); logs are DIR/*.log. Stop with tests/infra/stop.sh DIR.
#
# Isolation, so that several nodes (other test runs) can run on one machine:
# - The node (containerd, kubelet, kube-proxy, the CNI bridge and every pod's network)
#   lives in its own network namespace "haulage-ID", joined to the host by one veth
#   pair with a /30 of 10.213.0.0/16: the host side (HOST_IP) is where kube-apiserver
#   listens (pods reach it through the `kubernetes` Service that kube-proxy maps) and
#   where a test's S3 server must listen for pods to reach it. The node's namespace has
#   no route beyond that /30, so no pod traffic can leave the machine. Pods get
#   10.244.0.0/24 on the bridge, masqueraded to NODE_IP.
# - Pods' cgroups go under /haulage-ID (the kubelet's cgroupRoot, cgroupfs driver,
#   cgroup v1 or v2), containerd and its shims under /haulage-ID/runtime; stop.sh ends
#   exactly the processes in those cgroups.
# - containerd's root, state, socket, pod network namespaces and the kubelet's root
#   directory are all under DIR.
# The kubelet sets the kernel settings every Kubernetes node has (vm.overcommit_memory=1,
# kernel.panic=10, kernel.panic_on_oops=1, ...); the values before are saved in
# DIR/sysctl.saved and stop.sh puts them back.
set -euo pipefail

die() { echo "start-node.sh: error: $*" >&2; exit 1; }
log() { echo "start-node.sh: $*" >&2; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ $# -ge 1 ]] || die "usage: $0 DIR [--watch PID] [--image ARCHIVE]..."
mkdir -p "$1"
dir="$(cd "$1" && pwd)"
shift
watch_pid=""
images=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --watch) watch_pid="$2"; shift 2 ;;
        --image) images+=("$2"); shift 2 ;;
        *) die "unknown argument '$1'" ;;
    esac
done

[[ $EUID -eq 0 ]] || die "a real node needs root (containerd, network namespaces, cgroups, mounts)"
[[ ! -e "$dir/node.env" ]] || die "$dir/node.env exists: already running? (tests/infra/stop.sh $dir)"
for t in containerd containerd-shim-runc-v2 runc ctr ip nsenter iptables openssl curl; do
    command -v "$t" >/dev/null ||
        die "'$t' is not installed (apt-get install containerd runc containernetworking-plugins iptables iproute2 util-linux openssl curl)"
done
cni_bin=/usr/lib/cni
[[ -x "$cni_bin/bridge" && -x "$cni_bin/host-local" && -x "$cni_bin/loopback" ]] ||
    die "no CNI plugins in $cni_bin (apt-get install containernetworking-plugins)"

# ---- binaries ---------------------------------------------------------------------------
kube_bins="$("$here/build.sh" kube)"
kubectl_bin="$(sed -n 2p <<<"$kube_bins")"
node_bins="$("$here/build.sh" node)"
bin() { grep "/$1\$" <<<"$node_bins"; }
kcm_bin="$(bin kube-controller-manager)"
scheduler_bin="$(bin kube-scheduler)"
kubelet_bin="$(bin kubelet)"
proxy_bin="$(bin kube-proxy)"
pause_bin="$(bin pause)"

# ---- names and addresses ----------------------------------------------------------------
id="$(printf '%s' "$dir" | sha256sum | cut -c1-8)"
node_name="haulage-node"
netns="haulage-$id"
host_if="hlg$id"
cgroup_root="/haulage-$id"
pod_subnet="10.244.0.0/24"
service_range="10.0.0.0/24"
link=""
for _ in $(seq 1 100); do
    candidate="10.213.$((RANDOM % 256)).$((RANDOM % 64 * 4))"
    if [[ -z "$(ip -4 route show "$candidate/30")" && -z "$(ip -4 addr show to "$candidate/30")" ]]; then
        link="$candidate"; break
    fi
done
[[ -n "$link" ]] || die "no free /30 in 10.213.0.0/16 for the node's link"
prefix="${link%.*}"
last="${link##*.}"
host_ip="$prefix.$((last + 1))"
node_ip="$prefix.$((last + 2))"
volumes="$dir/volumes"
sock="$dir/containerd/containerd.sock"
mkdir -p "$volumes" "$dir/containerd" "$dir/cni/net.d" "$dir/kubelet"

# Written first: stop.sh reads it to undo whatever was set up, also after a failure.
cat >"$dir/node.env" <<EOF
NODE_NAME=$node_name
HOST_IP=$host_ip
NODE_IP=$node_ip
NETNS=$netns
HOST_IF=$host_if
CGROUP_ROOT=$cgroup_root
CONTAINERD_SOCKET=$sock
VOLUMES=$volumes
STORAGE_CLASS=haulage-local
POD_SUBNET=$pod_subnet
SERVICE_RANGE=$service_range
KUBECONFIG=$dir/kubeconfig
EOF

fail() {
    echo "start-node.sh: error: $*" >&2
    local l
    for l in "$dir"/*.log; do
        [[ -f "$l" ]] && { echo "--- last lines of $l" >&2; tail -n 15 "$l" >&2; }
    done
    "$here/stop.sh" "$dir" >&2 || true
    exit 1
}
trap 'fail "interrupted"' INT TERM
trap 'fail "command failed (line $LINENO): $BASH_COMMAND"' ERR

# A free TCP port on 127.0.0.1.
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
# wait_for WHAT SECONDS COMMAND... : poll COMMAND every 0.5 s (COMMAND keeps quiet;
# it may call fail, which stops everything).
wait_for() {
    local what="$1" seconds="$2" i
    shift 2
    for i in $(seq 1 $((seconds * 2))); do
        "$@" >/dev/null && return 0
        sleep 0.5
    done
    fail "$what not ready after ${seconds}s"
}
# running NAME : the process in DIR/NAME.pid still runs.
running() { kill -0 "$(cat "$dir/$1.pid")" 2>/dev/null || fail "$1 exited"; }
in_node() { nsenter --net="/run/netns/$netns" "$@"; }
kubectl() { "$kubectl_bin" --kubeconfig "$dir/kubeconfig" "$@"; }

# ---- the node's network namespace -------------------------------------------------------
ip netns add "$netns" || fail "ip netns add $netns"
ip link add "$host_if" type veth peer name eth0 netns "$netns" || fail "creating the veth pair"
ip addr add "$host_ip/30" dev "$host_if"
ip link set "$host_if" up
in_node ip link set lo up
in_node ip addr add "$node_ip/30" dev eth0
in_node ip link set eth0 up
# pods -> node -> host: the node routes for its pods (the sysctl is per namespace)
in_node sysctl -qw net.ipv4.ip_forward=1
# Service addresses route to a bridge without ports (a sink: this kernel has no dummy
# devices), so that the node's own connections to a Service pass the route lookup that
# comes before kube-proxy's rewrite (pods' connections are rewritten on the way in,
# before routing); an address kube-proxy does not map goes nowhere.
in_node ip link add svc0 type bridge
in_node ip link set svc0 up
in_node ip route add "$service_range" dev svc0
log "network namespace $netns: host $host_ip <-> node $node_ip, pods $pod_subnet"

# ---- control plane ----------------------------------------------------------------------
KUBE_ADDRESS="$host_ip" KUBE_NODE_NAME="$node_name" "$here/start-kube.sh" "$dir" >/dev/null ||
    fail "start-kube.sh failed"

kcm_port="$(free_port)"
setsid "$kcm_bin" \
    --kubeconfig="$dir/kubeconfig-kube-controller-manager" \
    --service-account-private-key-file="$dir/pki/sa.key" \
    --root-ca-file="$dir/pki/ca.crt" \
    --use-service-account-credentials \
    --service-cluster-ip-range="$service_range" \
    --leader-elect=false \
    --bind-address=127.0.0.1 --secure-port="$kcm_port" \
    --v=1 \
    </dev/null >"$dir/kube-controller-manager.log" 2>&1 &
echo $! >"$dir/kube-controller-manager.pid"

scheduler_port="$(free_port)"
cat >"$dir/kube-scheduler.yaml" <<EOF
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: $dir/kubeconfig-kube-scheduler
leaderElection:
  leaderElect: false
EOF
setsid "$scheduler_bin" \
    --config="$dir/kube-scheduler.yaml" \
    --bind-address=127.0.0.1 --secure-port="$scheduler_port" \
    --v=1 \
    </dev/null >"$dir/kube-scheduler.log" 2>&1 &
echo $! >"$dir/kube-scheduler.pid"

healthy() { running "$1"; [[ "$(curl -sk "https://127.0.0.1:$2/healthz" 2>/dev/null)" == ok ]]; }
wait_for kube-controller-manager 60 healthy kube-controller-manager "$kcm_port"
wait_for kube-scheduler 60 healthy kube-scheduler "$scheduler_port"
log "kube-controller-manager and kube-scheduler healthy"

# ---- containerd -------------------------------------------------------------------------
cat >"$dir/containerd/config.toml" <<EOF
version = 2
root = "$dir/containerd/root"
state = "$dir/containerd/state"

[grpc]
  address = "$sock"

[ttrpc]
  address = "$dir/containerd/containerd.sock.ttrpc"

# containerd and its shims in the node's cgroup, so stop.sh finds every process
[cgroup]
  path = "$cgroup_root/runtime"

[plugins."io.containerd.internal.v1.opt"]
  path = "$dir/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/haulage-test/pause:3.10.1"
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  # This machine's root lacks CAP_SYS_RESOURCE (not in its capability bounding set),
  # so no process may lower its oom_score_adj: runc failed every pod sandbox with
  # "failed to update /proc/self/oom_score_adj: Permission denied" (-998 for the
  # pause container). With this, containerd keeps pods' oom_score_adj at or above its
  # own, as for a rootless containerd.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # the kubelet's cgroupDriver is cgroupfs
        SystemdCgroup = false
        # runc's container state, apart from any other containerd on the machine
        Root = "$dir/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$cni_bin"
    conf_dir = "$dir/cni/net.d"
EOF
cat >"$dir/cni/net.d/10-haulage.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "haulage",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$dir/cni/networks",
        "ranges": [[{ "subnet": "$pod_subnet" }]],
        "routes": [{ "dst": "0.0.0.0/0" }]
      }
    }
  ]
}
EOF
setsid nsenter --net="/run/netns/$netns" containerd --config "$dir/containerd/config.toml" \
    </dev/null >"$dir/containerd.log" 2>&1 &
echo $! >"$dir/containerd.pid"
ctr_() { ctr --address "$sock" --namespace k8s.io "$@"; }
containerd_up() { running containerd; ctr_ version 2>/dev/null; }
wait_for containerd 60 containerd_up
log "containerd up ($sock)"

# ---- images -----------------------------------------------------------------------------
pause_archive="$("$here/build-images.sh" --out "$dir/images" --pause "$pause_bin" pause | cut -d' ' -f2)" ||
    fail "building the pause image failed"
for archive in "$pause_archive" "${images[@]}"; do
    ctr_ images import "$archive" >/dev/null || fail "ctr images import $archive failed"
    log "imported $archive"
done

# ---- kubelet ----------------------------------------------------------------------------
# The kernel settings the kubelet changes (see the header), to put back on stop.
: >"$dir/sysctl.saved"
for key in vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes; do
    printf '%s=%s\n' "$key" "$(sysctl -n "$key")" >>"$dir/sysctl.saved"
done
# The kubelet's cgroupRoot must exist in every hierarchy.
if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    mkdir -p "/sys/fs/cgroup$cgroup_root"
else
    for h in /sys/fs/cgroup/*/; do
        [[ -d "$h" && "$h" != /sys/fs/cgroup/unified/ ]] && mkdir -p "$h${cgroup_root#/}"
    done
fi
cat >"$dir/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://$sock
# cgroup v1 here: cgroupfs, as containerd's runc (SystemdCgroup = false); Kubernetes
# 1.34 still runs on v1 when failCgroupV1 is false (its default until 1.35)
cgroupDriver: cgroupfs
failCgroupV1: false
cgroupRoot: $cgroup_root
cgroupsPerQOS: true
address: $node_ip
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: $dir/pki/ca.crt
authorization:
  mode: Webhook
# no DNS: pods reach the API server and the test's S3 server by IP address
resolvConf: ""
clusterDomain: cluster.local
failSwapOn: false
# never delete the imported images, never evict on a busy test machine: "0%"
# turns a signal off (the kubelet ignores 0% and 100%). With 50Mi memory / 1%
# disk a CI run saw the controller's pods end as an eviction ends them
# (SIGTERM, so Completed, and a replacement Pending as behind a pressure
# taint): the kubelet counts active page cache of the tests' data as used.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "0%"
  nodefs.available: "0%"
  nodefs.inodesFree: "0%"
  imagefs.available: "0%"
  imagefs.inodesFree: "0%"
serializeImagePulls: false
kubeAPIQPS: 50
kubeAPIBurst: 100
EOF
setsid nsenter --net="/run/netns/$netns" "$kubelet_bin" \
    --config="$dir/kubelet/config.yaml" \
    --kubeconfig="$dir/kubeconfig-kubelet" \
    --hostname-override="$node_name" \
    --node-ip="$node_ip" \
    --root-dir="$dir/kubelet/root" \
    --v=1 \
    </dev/null >"$dir/kubelet.log" 2>&1 &
echo $! >"$dir/kubelet.pid"
node_ready() {
    running kubelet
    [[ "$(kubectl get node "$node_name" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}
wait_for "node $node_name" 120 node_ready
log "node $node_name Ready"
# Local PersistentVolumes (data under VOLUMES, node affinity to this node) are of this
# class; the PV controller binds a claim to the volume it names, at once.
kubectl apply -f - >/dev/null <<EOF || fail "creating the StorageClass haulage-local"
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: haulage-local
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: Immediate
EOF

# ---- kube-proxy -------------------------------------------------------------------------
cat >"$dir/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: $dir/kubeconfig-kube-proxy
hostnameOverride: $node_name
mode: iptables
clusterCIDR: $pod_subnet
bindAddress: $node_ip
nodePortAddresses: ["primary"]
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack:
  # the conntrack table size and timeouts are the host's, not this namespace's
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
EOF
setsid nsenter --net="/run/netns/$netns" "$proxy_bin" --config="$dir/kube-proxy.yaml" --v=1 \
    </dev/null >"$dir/kube-proxy.log" 2>&1 &
echo $! >"$dir/kube-proxy.pid"
# The `kubernetes` Service answers through kube-proxy's rules from inside the node.
service_reaches_apiserver() {
    running kube-proxy
    [[ "$(in_node curl -s --max-time 2 --cacert "$dir/pki/ca.crt" "https://10.0.0.1/readyz" 2>/dev/null)" == ok ]]
}
wait_for "the kubernetes Service through kube-proxy" 60 service_reaches_apiserver
log "kube-proxy maps the kubernetes Service (10.0.0.1:443) to $host_ip"

trap - INT TERM ERR
if [[ -n "$watch_pid" ]]; then
    setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; "$2/stop.sh" "$3" >"$3.stop.log" 2>&1 && rm -f "$3.stop.log"; rm -rf --one-file-system "$3"' \
        watchdog "$watch_pid" "$here" "$dir" </dev/null >/dev/null 2>&1 &
    log "stops when pid $watch_pid exits (log: $dir.stop.log)"
fi
echo "$dir/kubeconfig"
