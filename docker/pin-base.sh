#!/bin/sh
# Pins the Dockerfile's base image: writes the digest its tag names now into `ARG BASE_DIGEST=`. Run it once per Ray
# version (after changing ARG RAY_VERSION), review the diff and commit it; the build refuses an empty BASE_DIGEST.
# Needs docker with buildx; reads the registry's manifest, pulls nothing.
set -eu
cd "$(dirname "$0")/.."
ray_version="$(sed -n 's/^ARG RAY_VERSION=//p' Dockerfile)"
image="$(sed -n 's/^FROM \([^@]*\)@.*/\1/p' Dockerfile | sed "s/\${RAY_VERSION}/$ray_version/")"
digest="$(docker buildx imagetools inspect "$image" | sed -n 's/^Digest: *//p' | head -n 1)"
case "$digest" in
    sha256:*) ;;
    *) echo "no digest for $image" >&2; exit 1 ;;
esac
sed -i "s/^ARG BASE_DIGEST=.*/ARG BASE_DIGEST=$digest/" Dockerfile
echo "$image pinned to $digest"
