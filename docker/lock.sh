#!/bin/sh
# Regenerates docker/requirements.lock: pdserve's dependencies (pyproject.toml) and docker/requirements.in, each
# pinned with the sha256 of every file of its release (pip-compile --generate-hashes), for the Dockerfile's
# `pip install --require-hashes`. pip-tools goes into a throw-away venv, never the project's. Markers resolve for
# this interpreter: run it with the image's Python, 3.12 (PYTHON=python3.12 docker/lock.sh), where there is one.
set -eu
cd "$(dirname "$0")/.."
venv="$(mktemp -d)"
trap 'rm -rf "$venv"' EXIT
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/pip" install --quiet pip-tools
CUSTOM_COMPILE_COMMAND="docker/lock.sh" "$venv/bin/pip-compile" --quiet --generate-hashes --allow-unsafe \
    --strip-extras --no-emit-index-url --no-emit-find-links --output-file docker/requirements.lock \
    pyproject.toml docker/requirements.in
