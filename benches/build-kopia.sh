#!/usr/bin/env bash
# Build kopia (Velero's uploader, a peer of the comparison scripts) from its
# Go module into a cache outside the repository, and print the binary's path.
#
# Usage: benches/build-kopia.sh [VERSION]   (default v0.21.1)
# The binary goes to ${HAULAGE_BENCH_CACHE:-~/.cache/haulage-bench}/kopia-VERSION/bin/kopia;
# an existing one is reused. `go install github.com/kopia/kopia@VERSION` is
# refused by the module proxy (kopia's go.mod has replace directives), so
# the module is required from a scratch module and built there.
# Then: KOPIA=$(bash benches/build-kopia.sh) bash benches/compare-s3.sh ...
set -euo pipefail
VERSION="${1:-v0.21.1}"
CACHE="${HAULAGE_BENCH_CACHE:-$HOME/.cache/haulage-bench}"
OUT="$CACHE/kopia-$VERSION/bin/kopia"
if [ -x "$OUT" ]; then
    echo "$OUT"
    exit 0
fi
command -v go >/dev/null || { echo "build-kopia.sh: needs Go (https://go.dev/dl/)" >&2; exit 1; }
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
mkdir -p "$(dirname "$OUT")"
(
    cd "$SCRATCH"
    go mod init haulage.dev/bench-kopia >/dev/null 2>&1
    go get "github.com/kopia/kopia@$VERSION" >&2
    start=$(date +%s)
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$OUT" github.com/kopia/kopia >&2
    echo "build-kopia.sh: kopia $VERSION built in $(( $(date +%s) - start )) s" >&2
)
"$OUT" --version >&2
echo "$OUT"
