# pdserve on the Ray LLM image: Ray 2.60 (its llm extra pins vLLM 0.29.0, inside pdserve's range: docs/versions.md), NIXL,
# CUDA 13, Python 3.12. Ray's own image, not a CUDA base with our pins: KubeRay's head and workers must carry the
# RayService's rayVersion, and Ray builds and tests this image's vLLM, torch and CUDA together.
# The same image runs the Ray head (gateway) and the engine workers; `render k8s` names it in
# kubernetes.image and its Ray version in kubernetes.ray_version. See docs/deploy.md.
#   docker build -t pdserve:0.1.0 .      (or `make image`: docker/build-image.sh builds it and checks the result)
# RAY_VERSION must equal kubernetes.ray_version (a test checks the default; the build checks the image).
# BASE_DIGEST pins the base image: a tag can be moved to other content, a digest cannot. While it is empty the
# build stops at FROM, before anything is pulled ("BASE_DIGEST: unpinned-base-image:run-docker/pin-base.sh":
# BuildKit's ${VAR:?message}, moby/buildkit frontend/dockerfile/shell/lex.go); docker/pin-base.sh fills it with
# the digest the tag names now.
ARG RAY_VERSION=2.60.0
ARG BASE_DIGEST=
FROM rayproject/ray-llm:${RAY_VERSION}-py312-cu130@${BASE_DIGEST:?unpinned-base-image:run-docker/pin-base.sh}
ARG RAY_VERSION
LABEL io.ray.version=${RAY_VERSION}
RUN python -c "import ray, sys; sys.exit(ray.__version__ != '${RAY_VERSION}' and f'image has Ray {ray.__version__}, expected ${RAY_VERSION}')"

# EFA's user-space side (libfabric with the efa provider, rdma-core) for NIXL's LIBFABRIC backend;
# the kernel driver comes from the node. Skipped when the base image already has it.
# Pinned, not `latest`, so a rebuild gets the same libraries: 1.51.0 is libfabric 2.7.0amzn2.0 and
# rdma-core 65.0 (AWS's EFA installer changelog). The tarball is checked against AWS's GPG
# signature before it is unpacked, as AWS's EFA-in-containers guide and the EKS AMI's install script
# do; a bad signature stops the build. The key comes from the same host, so this catches a corrupt
# or swapped tarball, not a compromised host.
# The base image deletes its apt lists and efa_installer.sh apt-installs its dependencies (pciutils,
# environment-modules, libnl-3, …): `apt-get update` first, and the lists removed again after.
ARG EFA_INSTALLER_VERSION=1.51.0
RUN if [ ! -e /opt/amazon/efa/lib/libfabric.so ]; then \
        efa_tarball="aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
        && cd /tmp \
        && sudo apt-get update \
        && (command -v gpg > /dev/null || sudo apt-get install -y --no-install-recommends gnupg) \
        && export GNUPGHOME="$(mktemp -d)" \
        && curl -fsSLO https://efa-installer.amazonaws.com/aws-efa-installer.key \
        && curl -fsSLO "https://efa-installer.amazonaws.com/${efa_tarball}" \
        && curl -fsSLO "https://efa-installer.amazonaws.com/${efa_tarball}.sig" \
        && gpg --batch --import aws-efa-installer.key \
        && gpg --batch --verify "${efa_tarball}.sig" "${efa_tarball}" \
        && tar xzf "${efa_tarball}" \
        && cd aws-efa-installer \
        && sudo ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
        && cd / && sudo rm -rf "${GNUPGHOME}" /tmp/aws-efa-installer* /var/lib/apt/lists/*; \
    fi

COPY --chown=ray:users pyproject.toml setup.py README.md /home/ray/pdserve/
COPY --chown=ray:users pdserve /home/ray/pdserve/pdserve
COPY --chown=ray:users pdserve_vllm /home/ray/pdserve/pdserve_vllm
COPY --chown=ray:users docker/check-shared-libs.sh /home/ray/pdserve/docker/check-shared-libs.sh
COPY --chown=ray:users docker/requirements.lock /home/ray/pdserve/docker/requirements.lock
COPY --chown=ray:users docker/missing_from_image.py /home/ray/pdserve/docker/missing_from_image.py

# Every package the image already has keeps its version (vLLM, torch, Ray, NIXL where it has it). What pip adds
# comes from docker/requirements.lock only, pinned, each file checked against its sha256 (--require-hashes, with
# --no-deps: nothing unlocked comes along); docker/missing_from_image.py keeps the lock's entries the image lacks.
# pdserve itself is then installed without any index: a requirement of it that the image and the lock leave
# unmet, or a version it cannot use, fails the build.
RUN pip list --format=freeze > /tmp/image-packages.txt \
    && python /home/ray/pdserve/docker/missing_from_image.py /home/ray/pdserve/docker/requirements.lock \
        /tmp/image-packages.txt > /tmp/missing.lock \
    && pip install --no-cache-dir --require-hashes --no-deps -r /tmp/missing.lock \
    && pip install --no-cache-dir --no-index --no-build-isolation /home/ray/pdserve \
    && rm /tmp/image-packages.txt /tmp/missing.lock \
    && pdserve --help > /dev/null \
    && python -c "import nixl, vllm, pdserve" \
    && (python -c "import pdserve.pd._chunk_relay" 2>/dev/null \
        || echo "WARNING: pdserve's C chunk relay was not built (no C compiler?): the gateway relays every chunk in Python")

# NIXL's wheels leave libfabric, hwloc, libcuda and the EFA and verbs libraries out (ai-dynamo/nixl
# contrib/build-wheel.sh: auditwheel --exclude), and its LIBFABRIC plugin links libfabric, hwloc and numa
# (src/utils/libfabric/meson.build; libnuma comes inside the wheel under a hashed name). libfabric is the
# EFA installer's, in /opt/amazon/efa/lib, put on the loader's path here; hwloc comes from apt. The build
# fails when `ldd` finds any library the CUDA 13 wheel's plugin needs missing, but the NVIDIA driver's
# libcuda.so.1, which the node mounts when the container starts. The plugin checked is the one NIXL loads
# ("Loading plugins from: <site-packages>/nixl_cu13/../.nixl_cu13.mesonpy.libs/plugins" in its debug log;
# the wheel's second copy in nixl_cu13.libs/nixl is not loaded); no plugin found fails the build too.
RUN sudo apt-get update \
    && sudo apt-get install -y --no-install-recommends libhwloc15 \
    && sudo rm -rf /var/lib/apt/lists/* \
    && echo /opt/amazon/efa/lib | sudo tee /etc/ld.so.conf.d/000_efa.conf > /dev/null \
    && sudo ldconfig \
    && sh /home/ray/pdserve/docker/check-shared-libs.sh --at-run-time libcuda.so.1 \
        $(find "$(python -c "print(__import__('sysconfig').get_paths()['purelib'])")" \
            -path '*/.nixl_cu13.mesonpy.libs/plugins/libplugin_LIBFABRIC.so') \
    && /opt/amazon/efa/bin/fi_info -l | grep -q '^efa:'
