#!/bin/sh
# Builds libkvedge and installs it under a prefix (default /usr/local):
#
#   PREFIX/lib/libkvedge.so        the shared library
#   PREFIX/lib/libkvedge.a         the static library
#   PREFIX/include/kvedge.h        the header
#   PREFIX/lib/pkgconfig/kvedge.pc for `pkg-config --cflags --libs kvedge`
#
# Usage: client-c/install.sh [PREFIX]
# KVEDGE_PROFILE selects the cargo profile (default: release).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
prefix=${1:-/usr/local}
profile=${KVEDGE_PROFILE:-release}
case "$profile" in
    release) dir=release ;;
    dev | test) dir=debug ;;
    *) dir=$profile ;;
esac
cargo=${CARGO:-cargo}
"$cargo" build --profile "$profile" -p kvedge-c --lib --manifest-path "$here/../Cargo.toml"
target=${CARGO_TARGET_DIR:-$here/../target}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$here/../Cargo.toml" | head -n 1)
mkdir -p "$prefix/lib/pkgconfig" "$prefix/include"
install -m 0755 "$target/$dir/libkvedge.so" "$prefix/lib/libkvedge.so"
install -m 0644 "$target/$dir/libkvedge.a" "$prefix/lib/libkvedge.a"
install -m 0644 "$here/include/kvedge.h" "$prefix/include/kvedge.h"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" "$here/kvedge.pc.in" \
    > "$prefix/lib/pkgconfig/kvedge.pc"
echo "installed libkvedge $version under $prefix"
