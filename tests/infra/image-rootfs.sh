#!/usr/bin/env bash
# Lay out the root filesystem of a haulage image in DIR: the binary BIN (stripped of
# debug info) at /usr/local/bin/NAME, every shared library it loads at the path ldd
# resolves it to, Debian's CA bundle, passwd/group with root and nonroot (65532, as
# distroless images have) and a world-writable /tmp. Nothing else: no shell, no
# package manager.
#
# Usage: tests/infra/image-rootfs.sh BIN DIR
#
# The one place the image layout is defined: the Containerfile's build stage runs it,
# and tests/infra/build-images.sh (the daemonless build) runs it before `buildah
# commit`. Needs ldd, strip and /etc/ssl/certs/ca-certificates.crt (Debian:
# libc-bin, binutils, ca-certificates).
set -euo pipefail

die() { echo "image-rootfs.sh: error: $*" >&2; exit 1; }

[[ $# -eq 2 ]] || die "usage: $0 BIN DIR"
bin="$1" dir="$2"
ca_bundle=/etc/ssl/certs/ca-certificates.crt
[[ -x "$bin" ]] || die "$bin is missing or not executable: build it first (cargo build --release -p haulage -p mover-agent)"
[[ -f "$ca_bundle" ]] || die "$ca_bundle is missing (apt-get install ca-certificates)"
for t in ldd strip; do command -v "$t" >/dev/null || die "'$t' is not installed (apt-get install libc-bin binutils)"; done

mkdir -p "$dir/usr/local/bin" "$dir/etc/ssl/certs" "$dir/tmp"
chmod 1777 "$dir/tmp"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$dir/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$dir/etc/group"
# Debug info out, symbols kept: a panic's backtrace still names its functions.
strip --strip-debug -o "$dir/usr/local/bin/$(basename "$bin")" "$bin"
# ldd prints "name => /path (addr)" for a library and "/lib64/ld-linux... (addr)" for
# the loader; a static binary prints "not a dynamic executable" (nothing to copy).
libs="$(ldd "$bin" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')" || true
for lib in $libs; do
    mkdir -p "$dir$(dirname "$lib")"
    cp -L "$lib" "$dir$lib"
done
cp -L "$ca_bundle" "$dir$ca_bundle"
