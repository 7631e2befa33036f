#!/usr/bin/env bash
# Build haulage's container images without a daemon and without pulling any base
# image: each image is `buildah from scratch` plus the root filesystem that
# tests/infra/image-rootfs.sh lays out (the binary, the shared libraries it links,
# Debian's CA certificates, passwd/group), one layer. The multi-stage Containerfile at
# the repository root runs the same image-rootfs.sh in its build stage, so both give
# the same layout; the Containerfile needs a registry for its build image, this
# script needs none.
#
# Usage: tests/infra/build-images.sh [options] [controller|agent|pause|all|names]
#   (default: all; `names` only prints the controller's and the agent's image names)
#   --bin-dir DIR   where the `haulage` and `mover-agent` binaries are
#                   (default: target/release; build them with
#                   `cargo build --release -p haulage -p mover-agent`)
#   --out DIR       where the image archives go (default: target/images)
#   --repo REPO     image repository prefix (default: ghcr.io/haulage-dev)
#   --tag TAG       image tag (default: the workspace version in Cargo.toml)
#   --pause BIN     the pause binary for the pause image (default: the one
#                   `tests/infra/build.sh node` built)
#
# Prints one line per image on stdout: NAME ARCHIVE, where ARCHIVE is a docker-archive
# tar (`ctr image import`, `podman load`, `docker load`, or `skopeo copy
# docker-archive:ARCHIVE docker://REGISTRY/...` to push). Needs root (or a buildah set
# up for rootless use) and buildah, plus what image-rootfs.sh needs.
set -euo pipefail

die() { echo "build-images.sh: error: $*" >&2; exit 1; }
log() { echo "build-images.sh: $*" >&2; }

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin_dir="$root/target/release"
out="$root/target/images"
repo="ghcr.io/haulage-dev"
tag=""
pause_bin=""
what=all
while [[ $# -gt 0 ]]; do
    case "$1" in
        --bin-dir) bin_dir="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --repo) repo="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        --pause) pause_bin="$2"; shift 2 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        controller|agent|pause|all|names) what="$1"; shift ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done

# The workspace version: the image tag and the version label.
version="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' "$root/Cargo.toml")"
[[ -n "$version" ]] || die "no version in [workspace.package] of $root/Cargo.toml"
tag="${tag:-$version}"
revision="$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
# Where the source of these images lives (the label registries link images to).
source_url="${HAULAGE_IMAGE_SOURCE:-https://github.com/haulage-dev/haulage}"
ca_bundle=/etc/ssl/certs/ca-certificates.crt

if [[ "$what" == names ]]; then
    echo "$repo/haulage:$tag"
    echo "$repo/mover-agent:$tag"
    exit 0
fi
command -v buildah >/dev/null || die "'buildah' is not installed (apt-get install buildah)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# buildah's storage lives in a throwaway directory: nothing is left in
# /var/lib/containers, and concurrent runs do not share state.
work="$(mktemp -d "${TMPDIR:-/tmp}/haulage-images.XXXXXX")"
cleanup() {
    buildah "${store[@]}" rm --all >/dev/null 2>&1 || true
    buildah "${store[@]}" rmi --all --force >/dev/null 2>&1 || true
    rm -rf "$work"
}
store=(--root "$work/storage" --runroot "$work/run" --storage-driver vfs)
trap cleanup EXIT

# commit NAME VERSION ROOTFS CONFIG... : an image of ROOTFS (one layer), configured by
# the buildah config options CONFIG..., labelled with VERSION, saved as a docker-archive.
commit() {
    local name="$1" image_version="$2" rootfs="$3" container archive
    shift 3
    container="$(buildah "${store[@]}" from scratch)"
    buildah "${store[@]}" copy --quiet "$container" "$rootfs" / >/dev/null
    buildah "${store[@]}" config \
        --label "org.opencontainers.image.version=$image_version" \
        --label "org.opencontainers.image.revision=$revision" \
        --label "org.opencontainers.image.source=$source_url" \
        --label "org.opencontainers.image.licenses=Apache-2.0" \
        --env "SSL_CERT_FILE=$ca_bundle" \
        "$@" "$container"
    buildah "${store[@]}" commit --quiet --rm "$container" "$name" >/dev/null
    archive="$out/$(basename "${name%%:*}").tar"
    rm -f "$archive"
    buildah "${store[@]}" push --quiet "$name" "docker-archive:$archive:$name" >/dev/null
    log "$name: $(du -h "$archive" | cut -f1) in $archive"
    echo "$name $archive"
}

build_controller() {
    local r="$work/controller"
    "$root/tests/infra/image-rootfs.sh" "$bin_dir/haulage" "$r"
    commit "$repo/haulage:$tag" "$version" "$r" \
        --label "org.opencontainers.image.title=haulage" \
        --label "org.opencontainers.image.description=haulage controller and CLI" \
        --user 65532:65532 --workingdir / \
        --entrypoint '["/usr/local/bin/haulage"]' --cmd '["controller"]'
}

build_agent() {
    local r="$work/agent"
    "$root/tests/infra/image-rootfs.sh" "$bin_dir/mover-agent" "$r"
    # The stage pod sets the user (root with DAC_OVERRIDE for a backup, or a
    # non-root uid); the image's default is root, as the agent reads every file.
    commit "$repo/mover-agent:$tag" "$version" "$r" \
        --label "org.opencontainers.image.title=mover-agent" \
        --label "org.opencontainers.image.description=haulage mover agent (runs in stage pods)" \
        --user 0:0 --workingdir / \
        --entrypoint '["/usr/local/bin/mover-agent"]'
}

# The sandbox ("pause") image the test node's containerd names as sandbox_image, also
# the image of the test workloads that only need to hold a volume mounted.
build_pause() {
    local r="$work/pause" bin="$pause_bin"
    if [[ -z "$bin" ]]; then
        bin="$("$root/tests/infra/build.sh" node | grep '/pause$')" || die "no pause binary (tests/infra/build.sh node)"
    fi
    [[ -x "$bin" ]] || die "pause binary $bin is missing"
    mkdir -p "$r"
    cp "$bin" "$r/pause"
    commit "localhost/haulage-test/pause:3.10.1" 3.10.1 "$r" \
        --label "org.opencontainers.image.title=pause" \
        --label "org.opencontainers.image.description=sandbox image of haulage's test node (kubernetes build/pause)" \
        --user 65535:65535 --entrypoint '["/pause"]'
}

case "$what" in
    controller) build_controller ;;
    agent) build_agent ;;
    pause) build_pause ;;
    all) build_controller; build_agent ;;
esac
