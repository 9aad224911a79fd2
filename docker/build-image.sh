#!/bin/sh
# Builds the Dockerfile and checks the image it made, outside any CI: `docker/build-image.sh [TAG]` (make image).
# The base image must be pinned first (docker/pin-base.sh). The checks, in the built image: pdserve, vLLM and NIXL
# import; NIXL's LIBFABRIC plugin finds every library it links (docker/check-shared-libs.sh); libfabric lists its
# efa provider (`fi_info -l`). Needs docker (BuildKit) and network; no GPU.
set -eu
cd "$(dirname "$0")/.."
tag="${1:-pdserve:0.1.0}"
command -v docker > /dev/null || { echo "build-image.sh: docker is not on PATH; install Docker Engine" >&2; exit 2; }
docker info > /dev/null 2>&1 || { echo "build-image.sh: no Docker daemon answers (docker info)" >&2; exit 2; }
grep -q '^ARG BASE_DIGEST=sha256:' Dockerfile || { echo "build-image.sh: the base image is not pinned; run docker/pin-base.sh" >&2; exit 2; }
DOCKER_BUILDKIT=1 docker build --tag "$tag" .
docker run --rm --entrypoint sh "$tag" -c '
    set -eu
    python -c "import nixl, vllm, pdserve; print(\"imports: nixl, vllm\", vllm.__version__, \"pdserve\")"
    plugin="$(find "$(python -c "import sysconfig; print(sysconfig.get_paths()[\"purelib\"])")" \
        -path "*/.nixl_cu13.mesonpy.libs/plugins/libplugin_LIBFABRIC.so")"
    sh /home/ray/pdserve/docker/check-shared-libs.sh --at-run-time libcuda.so.1 $plugin
    /opt/amazon/efa/bin/fi_info -l | grep -q "^efa:" || { echo "fi_info -l lists no efa provider" >&2; exit 1; }
    echo "image checks passed"'
echo "built and checked $tag"
