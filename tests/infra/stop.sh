#!/usr/bin/env bash
# Stop what tests/infra/start-kube.sh started in DIR: only the PIDs in DIR/*.pid, and
# only if each still runs the expected program. Leaves DIR (data, logs) in place.
#
# Usage: tests/infra/stop.sh DIR
set -uo pipefail

[[ $# -eq 1 && -d "$1" ]] || { echo "usage: $0 DIR" >&2; exit 2; }
dir="$1"

# stop NAME : TERM, wait up to 10s, then KILL; NAME is both the pid file and the program.
stop() {
    local name="$1" f="$dir/$1.pid" pid exe
    [[ -f "$f" ]] || return 0
    pid="$(cat "$f")"
    if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
        exe="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -d' ' -f1)"
        if [[ "$(basename "$exe")" != "$name" ]]; then
            echo "stop.sh: pid $pid is '$exe', not $name; left alone" >&2
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

# apiserver first, so it does not log etcd errors while shutting down
stop kube-apiserver
stop etcd
