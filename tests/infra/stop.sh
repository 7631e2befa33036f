#!/usr/bin/env bash
# Stop what tests/infra/start-kube.sh or tests/infra/start-node.sh started in DIR: only
# the PIDs in DIR/*.pid (each only if it still runs the expected program) and, for a
# node, the processes in the node's own cgroups (containers, containerd's shims,
# containerd). A node's mounts under DIR, its cgroups, its network namespace and veth
# pair are removed and the kernel settings the kubelet changed are put back. Leaves
# DIR (data, logs) in place.
#
# Usage: tests/infra/stop.sh DIR
#   Exits 1 when something could not be stopped or removed (each named on stderr).
set -uo pipefail

[[ $# -eq 1 && -d "$1" ]] || { echo "usage: $0 DIR" >&2; exit 2; }
dir="$(cd "$1" && pwd)"
problems=0
problem() { echo "stop.sh: $*" >&2; problems=$((problems + 1)); }

# stop NAME : TERM, wait up to 10s, then KILL; NAME is both the pid file and the program.
stop() {
    local name="$1" f="$dir/$1.pid" pid exe
    [[ -f "$f" ]] || return 0
    pid="$(cat "$f")"
    if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
        exe="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -d' ' -f1)"
        if [[ "$(basename "$exe")" != "$name" ]]; then
            problem "pid $pid is '$exe', not $name; left alone"
        else
            kill -TERM "$pid" 2>/dev/null
            for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            if kill -0 "$pid" 2>/dev/null; then
                echo "stop.sh: $name (pid $pid) ignored TERM; killing" >&2
                kill -KILL "$pid" 2>/dev/null
            fi
        fi
    fi
    rm -f "$f"
}

# The cgroup directories of CGROUP_ROOT: one per v1 hierarchy, or the v2 one.
node_cgroups() {
    if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
        [[ -d "/sys/fs/cgroup$CGROUP_ROOT" ]] && echo "/sys/fs/cgroup$CGROUP_ROOT"
    else
        local h
        for h in /sys/fs/cgroup/*/; do
            [[ -d "$h${CGROUP_ROOT#/}" ]] && echo "$h${CGROUP_ROOT#/}"
        done
    fi
    return 0
}

# Every process in the node's cgroups, until none is left.
kill_node_processes() {
    local pids cg
    for _ in $(seq 1 20); do
        pids="$(for cg in $(node_cgroups); do find "$cg" -name cgroup.procs -exec cat {} + 2>/dev/null; done | sort -un)"
        [[ -z "$pids" ]] && return 0
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null
        sleep 0.5
    done
    problem "processes left in $CGROUP_ROOT: $pids"
}

if [[ -f "$dir/node.env" ]]; then
    # shellcheck disable=SC1091
    source "$dir/node.env"
    stop kube-proxy
    stop kubelet
    stop containerd
    kill_node_processes
    # kubelet volume mounts, containerd's overlay and pod network namespace mounts
    while read -r target; do
        umount -l "$target" 2>/dev/null || problem "could not unmount $target"
    done < <(findmnt -rn -o TARGET | grep -F "$dir/" | sort -r)
    for cg in $(node_cgroups); do
        find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null || problem "could not remove cgroup $cg"
    done
    if [[ -f "$dir/sysctl.saved" ]]; then
        sysctl -q -p "$dir/sysctl.saved" >/dev/null ||
            problem "could not restore the kernel settings in $dir/sysctl.saved"
        rm -f "$dir/sysctl.saved"
    fi
    stop kube-scheduler
    stop kube-controller-manager
fi

# apiserver first, so it does not log etcd errors while shutting down (and before the
# node's network goes: it listens on the host side of it)
stop kube-apiserver
stop etcd

if [[ -f "$dir/node.env" ]]; then
    if ip netns list | grep -qw "$NETNS"; then
        ip netns delete "$NETNS" || problem "could not delete network namespace $NETNS"
    fi
    if ip link show "$HOST_IF" >/dev/null 2>&1; then
        ip link delete "$HOST_IF" || problem "could not delete $HOST_IF"
    fi
    rm -f "$dir/node.env"
fi
[[ $problems -eq 0 ]]
