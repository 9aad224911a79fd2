# pdserve on the Ray LLM image: Ray 2.58, vLLM 0.26, NIXL, CUDA 13, Python 3.12.
# The same image runs the Ray head (gateway) and the engine workers; `render k8s` names it in
# kubernetes.image and its Ray version in kubernetes.ray_version. See docs/deploy.md.
#   docker build -t pdserve:latest .
FROM rayproject/ray-llm:2.58.0-py312-cu130

# EFA's user-space side (libfabric with the efa provider, rdma-core) for NIXL's LIBFABRIC backend;
# the kernel driver comes from the node. Skipped when the base image already has it.
ARG EFA_INSTALLER_VERSION=latest
RUN if [ ! -e /opt/amazon/efa/lib/libfabric.so ]; then \
        cd /tmp \
        && curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" | tar xz \
        && cd aws-efa-installer \
        && sudo ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
        && cd / && sudo rm -rf /tmp/aws-efa-installer /var/lib/apt/lists/*; \
    fi

COPY --chown=ray:users pyproject.toml README.md /home/ray/pdserve/
COPY --chown=ray:users pdserve /home/ray/pdserve/pdserve
COPY --chown=ray:users pdserve_vllm /home/ray/pdserve/pdserve_vllm

# Every package the image already has keeps its version (vLLM, torch, Ray, NIXL): pip only adds
# what pdserve needs and the image lacks, and fails loudly if pdserve needs another version.
RUN pip list --format=freeze > /tmp/image-packages.txt \
    && (python -c "import nixl" 2>/dev/null \
        || pip install --no-cache-dir --constraint /tmp/image-packages.txt nixl-cu13) \
    && pip install --no-cache-dir --constraint /tmp/image-packages.txt /home/ray/pdserve \
    && rm /tmp/image-packages.txt \
    && pdserve --help > /dev/null
