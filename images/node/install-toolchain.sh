#!/bin/sh
# Unpack the verified tarballs of fusion-oci-dist/ into PREFIX laid out as /usr/local, the way
# Node.js's own distribution and `npm install -g` lay it out: bin/node, lib/node_modules/NAME,
# bin/COMMAND -> ../lib/node_modules/NAME/PATH. Only sh, tar and gzip are needed (the base has
# no node yet), so the package.json "bin" entries come in as build args (NPM_BINS, PM_BINS:
# "command=path ..."), read by fusion-oci from the registry's metadata.
set -eu
dist=$1
prefix=$2
mkdir -p "$prefix/bin" "$prefix/lib/node_modules"

unpack() {  # tarball, package dir, bins
    mkdir -p "$prefix/lib/node_modules/$2"
    tar -xzf "$1" -C "$prefix/lib/node_modules/$2" --strip-components=1 --no-same-owner
    for entry in $3; do
        command=${entry%%=*}
        path=${entry#*=}
        chmod 755 "$prefix/lib/node_modules/$2/$path"
        ln -sf "../lib/node_modules/$2/$path" "$prefix/bin/$command"
    done
}

if [ -f "$dist/node.tgz" ]; then
    tar -xzf "$dist/node.tgz" -C "$prefix" --strip-components=1 --no-same-owner \
        package/bin/node package/include package/share
    chmod 755 "$prefix/bin/node"
fi
if [ -f "$dist/npm.tgz" ]; then
    unpack "$dist/npm.tgz" npm "$NPM_BINS"
fi
if [ -f "$dist/pm.tgz" ]; then
    unpack "$dist/pm.tgz" "$PM_DIR" "$PM_BINS"
fi
# pnpm >= 11: its commands are placeholders its install script overwrites with the native
# binary from @pnpm/exe.linux-x64 (pm-native.tgz); the same, without running the script.
if [ -f "$dist/pm-native.tgz" ]; then
    native=$prefix/lib/node_modules/$PM_DIR/.pnpm-native
    mkdir -p "$native"
    tar -xzf "$dist/pm-native.tgz" -C "$native" --strip-components=1 --no-same-owner
    chmod 755 "$native/pnpm"
    for entry in $PM_BINS; do  # hard links: one 70 MB binary, not one per command
        ln -f "$native/pnpm" "$prefix/lib/node_modules/$PM_DIR/${entry#*=}"
    done
    rm -rf "$native"
fi
