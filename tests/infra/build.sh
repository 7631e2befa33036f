#!/usr/bin/env bash
# Build the real test infrastructure (MinIO, etcd, kube-apiserver + kubectl, and the
# node: kube-controller-manager, kube-scheduler, kubelet, kube-proxy and the pause
# binary of the sandbox image) from their Go modules into a cache outside the
# repository, keyed by version:
#
#   ${HAULAGE_INFRA_CACHE:-$HOME/.cache/haulage-infra}/<name>-<version>/bin/<binary>
#
# Usage: tests/infra/build.sh [minio|etcd|kube|node|all]   (default: all)
#
# Idempotent: a component whose binaries already exist is skipped. Each build runs in
# a throwaway wrapper module in a temp dir (nothing is written into the repository)
# and under `nice -n 19`. Binaries are moved into place only after a successful build.
# See docs/test-infra.md for times, disk use and how to start the servers.
set -euo pipefail

# ---- pinned versions --------------------------------------------------------------
# MinIO publishes only RELEASE.* tags (not semver) and the module proxy here refuses
# those queries, so MinIO is pinned by the pseudo-version of the final commit of the
# (archived) upstream repository.
MINIO_VERSION=v0.0.0-20260212201848-7aac2a2c5b7c
ETCD_VERSION=v3.6.16
KUBE_VERSION=v1.34.4
KUBE_STAGING_VERSION=v0.34.4   # published version of every k8s.io staging module
# ------------------------------------------------------------------------------------

CACHE="${HAULAGE_INFRA_CACHE:-$HOME/.cache/haulage-infra}"

die() { echo "build.sh: error: $*" >&2; exit 1; }
log() { echo "build.sh: $*" >&2; }

command -v go >/dev/null 2>&1 || die "the 'go' command is not installed (need Go >= 1.26 for etcd $ETCD_VERSION)"

# Use the machine's Go as is (never download a toolchain); resolve missing go.sum
# entries while building inside the wrapper module.
export GOTOOLCHAIN=local
export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0

WORKDIRS=()
cleanup() { local d; for d in "${WORKDIRS[@]}"; do chmod -R u+w "$d" 2>/dev/null; rm -rf "$d"; done; }
trap cleanup EXIT

# new_wrapper NAME GO_LINE : sets $w to a fresh temp dir holding a go.mod (module + go
# line); the dir is removed when the script exits.
new_wrapper() {
    w="$(mktemp -d "${TMPDIR:-/tmp}/haulage-infra-$1.XXXXXX")"
    WORKDIRS+=("$w")
    printf 'module haulage.local/infra/%s\n\ngo %s\n' "$1" "$2" >"$w/go.mod"
}

# fetch DIR PKG@VERSION... : add exactly what these commands need to the wrapper's
# go.mod/go.sum (minimal version selection from the pinned module's own go.mod; unlike
# `go mod tidy`, this never resolves a missing test dependency to "latest").
fetch() {
    local d="$1"; shift
    (cd "$d" && nice -n 19 go get "$@") >"$d/go-get.log" 2>&1 || {
        tail -n 30 "$d/go-get.log" >&2
        return 1
    }
}

# go_build DIR OUT PKG [LDFLAGS] : build one command, trimmed and stripped, at lowest
# priority.
go_build() {
    (cd "$1" && nice -n 19 go build -trimpath -ldflags "-s -w ${4:-}" -o "$2" "$3")
}

# install_bins NAME-VERSION STAGING_DIR : move built binaries into the cache atomically.
install_bins() {
    local dest="$CACHE/$1"
    mkdir -p "$dest"
    rm -rf "$dest/bin.tmp"
    mv "$2" "$dest/bin.tmp"
    rm -rf "${dest:?}/bin"
    mv "$dest/bin.tmp" "$dest/bin"
}

have() { local f; for f in "$@"; do [[ -x "$f" ]] || return 1; done; }

# lock NAME-VERSION : serialise builds of one component across concurrent runs (e.g. several
# test processes calling build.sh at once); the caller re-checks the cache after it.
lock() {
    mkdir -p "$CACHE"
    command -v flock >/dev/null 2>&1 || return 0
    exec {lockfd}>"$CACHE/.$1.lock"
    flock "$lockfd"
}

build_minio() {
    local id="minio-$MINIO_VERSION" bin="$CACHE/minio-$MINIO_VERSION/bin/minio"
    if have "$bin"; then log "minio: cached"; echo "$bin"; return; fi
    lock "$id"
    if have "$bin"; then log "minio: built meanwhile by another run"; echo "$bin"; return; fi
    log "minio: building github.com/minio/minio@$MINIO_VERSION (several minutes)"
    local start=$SECONDS w
    new_wrapper minio 1.24.0
    fetch "$w" "github.com/minio/minio@$MINIO_VERSION" || die "minio: go get failed (module proxy reachable?)"
    mkdir -p "$w/out"
    go_build "$w" "$w/out/minio" github.com/minio/minio || die "minio: go build failed"
    install_bins "$id" "$w/out"
    log "minio: built in $((SECONDS - start))s"
    echo "$bin"
}

build_etcd() {
    local id="etcd-$ETCD_VERSION" bin="$CACHE/etcd-$ETCD_VERSION/bin/etcd"
    if have "$bin"; then log "etcd: cached"; echo "$bin"; return; fi
    lock "$id"
    if have "$bin"; then log "etcd: built meanwhile by another run"; echo "$bin"; return; fi
    log "etcd: building go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    local start=$SECONDS w
    new_wrapper etcd 1.26.0
    fetch "$w" "go.etcd.io/etcd/server/v3@$ETCD_VERSION" || die "etcd: go get failed (module proxy reachable? Go >= 1.26?)"
    mkdir -p "$w/out"
    go_build "$w" "$w/out/etcd" go.etcd.io/etcd/server/v3 || die "etcd: go build failed"
    install_bins "$id" "$w/out"
    log "etcd: built in $((SECONDS - start))s"
    echo "$bin"
}

# kube_wrapper NAME CMD... : sets $w to a wrapper module that can build k8s.io/kubernetes'
# commands CMD... (e.g. cmd/kubelet) at $KUBE_VERSION.
kube_wrapper() {
    local name="$1" mod c pkgs=()
    shift
    # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with
    # ./staging/... paths, which do not apply to a dependency. Replace every one of them
    # (the list is read from kubernetes' own go.mod) with its published version.
    new_wrapper "$name" 1.24.0
    mod="$(cd "$w" && go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
    [[ -f "$mod" ]] || die "$name: could not download k8s.io/kubernetes@$KUBE_VERSION"
    {
        printf '\n// as in kubernetes own go.mod\ngodebug default=go1.24\n'
        printf '\nreplace (\n'
        sed -n '/^replace (/,/^)/p' "$mod" |
            awk -v v="$KUBE_STAGING_VERSION" '$2 == "=>" && $3 ~ /^\.\/staging\// { printf "\t%s => %s %s\n", $1, $1, v }'
        printf ')\n'
    } >>"$w/go.mod"
    grep -q 'k8s.io/apiserver => k8s.io/apiserver' "$w/go.mod" || die "$name: no staging replaces found in $mod"
    for c in "$@"; do pkgs+=("k8s.io/kubernetes/$c@$KUBE_VERSION"); done
    fetch "$w" "${pkgs[@]}" || die "$name: go get failed"
}

# kube_ldflags : the -X flags stamping the version, as upstream's hack/lib/version.sh
# does; without them the binaries report v0.0.0-master+$Format:%H$ (kubectl warns,
# clients see a bogus /version, the kubelet registers a bogus node version).
kube_ldflags() {
    local ld="" vpkg minor="${KUBE_VERSION#v1.}"
    minor="${minor%%.*}"
    for vpkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ld+=" -X $vpkg.gitVersion=$KUBE_VERSION -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$minor"
        ld+=" -X $vpkg.gitTreeState=clean -X $vpkg.buildDate=1970-01-01T00:00:00Z"
    done
    echo "$ld"
}

build_kube() {
    local id="kube-$KUBE_VERSION" dir="$CACHE/kube-$KUBE_VERSION/bin"
    if have "$dir/kube-apiserver" "$dir/kubectl"; then
        log "kube: cached"; echo "$dir/kube-apiserver"; echo "$dir/kubectl"; return
    fi
    lock "$id"
    if have "$dir/kube-apiserver" "$dir/kubectl"; then
        log "kube: built meanwhile by another run"; echo "$dir/kube-apiserver"; echo "$dir/kubectl"; return
    fi
    log "kube: building k8s.io/kubernetes@$KUBE_VERSION kube-apiserver + kubectl (tens of minutes on 2 cores)"
    local start=$SECONDS w ld
    kube_wrapper kube cmd/kube-apiserver cmd/kubectl
    ld="$(kube_ldflags)"
    mkdir -p "$w/out"
    local s2=$SECONDS
    go_build "$w" "$w/out/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver "$ld" || die "kube: building kube-apiserver failed"
    log "kube: kube-apiserver built in $((SECONDS - s2))s"
    s2=$SECONDS
    go_build "$w" "$w/out/kubectl" k8s.io/kubernetes/cmd/kubectl "$ld" || die "kube: building kubectl failed"
    log "kube: kubectl built in $((SECONDS - s2))s"
    install_bins "$id" "$w/out"
    log "kube: built in $((SECONDS - start))s"
    echo "$dir/kube-apiserver"; echo "$dir/kubectl"
}

# The node: kube-controller-manager, kube-scheduler, kubelet and kube-proxy from the same
# wrapper as kube-apiserver (the Go build cache makes the shared packages free), and
# `pause`, the sandbox container's process, compiled from the C source in the same
# k8s.io/kubernetes module (build/pause/linux/pause.c) with the machine's cc, statically,
# as upstream's build/pause/Makefile does.
NODE_BINARIES=(kube-controller-manager kube-scheduler kubelet kube-proxy pause)
PAUSE_VERSION=3.10.1   # TAG of build/pause/Makefile in k8s.io/kubernetes@$KUBE_VERSION

build_node() {
    local id="kube-node-$KUBE_VERSION" dir="$CACHE/kube-node-$KUBE_VERSION/bin" b paths=()
    for b in "${NODE_BINARIES[@]}"; do paths+=("$dir/$b"); done
    if have "${paths[@]}"; then log "node: cached"; printf '%s\n' "${paths[@]}"; return; fi
    lock "$id"
    if have "${paths[@]}"; then log "node: built meanwhile by another run"; printf '%s\n' "${paths[@]}"; return; fi
    command -v cc >/dev/null 2>&1 || die "node: no C compiler 'cc' for the pause binary (apt-get install gcc libc6-dev)"
    log "node: building k8s.io/kubernetes@$KUBE_VERSION kube-controller-manager, kube-scheduler, kubelet, kube-proxy"
    local start=$SECONDS w ld s2 c src
    kube_wrapper kube-node cmd/kube-controller-manager cmd/kube-scheduler cmd/kubelet cmd/kube-proxy
    ld="$(kube_ldflags)"
    mkdir -p "$w/out"
    for c in kube-controller-manager kube-scheduler kubelet kube-proxy; do
        s2=$SECONDS
        go_build "$w" "$w/out/$c" "k8s.io/kubernetes/cmd/$c" "$ld" || die "node: building $c failed"
        log "node: $c built in $((SECONDS - s2))s"
    done
    src="$(cd "$w" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c"
    [[ -f "$src" ]] || die "node: $src is missing from the module"
    nice -n 19 cc -Os -Wall -Werror -static -DVERSION="v$PAUSE_VERSION-haulage" -o "$w/out/pause" "$src" ||
        die "node: compiling pause.c failed (static libc: apt-get install libc6-dev)"
    install_bins "$id" "$w/out"
    log "node: built in $((SECONDS - start))s"
    printf '%s\n' "${paths[@]}"
}

what="${1:-all}"
case "$what" in
    minio) build_minio ;;
    etcd) build_etcd ;;
    kube) build_kube ;;
    node) build_node ;;
    all) build_minio; build_etcd; build_kube; build_node ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) die "unknown component '$what' (use minio, etcd, kube, node or all)" ;;
esac
