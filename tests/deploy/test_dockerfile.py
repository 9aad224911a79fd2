"""The Dockerfile cannot be built here: check what it builds on, installs and runs instead."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from pdserve.config import KubernetesSpec

REPO = Path(__file__).parents[2]
RAY_LLM_IMAGE = re.compile(r"rayproject/ray-llm:(?P<ray_version>\d+\.\d+\.\d+)-py3\d+-cu\d+")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (REPO / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(word.upper(), rest.strip()) for word, _, rest in
            (line.strip().partition(" ") for line in joined.splitlines() if line.strip())]


def arguments(name: str) -> list[str]:
    return [rest for word, rest in instructions() if word == name]


def pip_installs() -> list[str]:
    return [command for run in arguments("RUN") for command in re.split(r"&&|\|\|", run) if "pip install" in command]


def test_base_image_is_the_ray_llm_image_of_the_default_ray_version() -> None:
    (base,) = arguments("FROM")
    match = RAY_LLM_IMAGE.fullmatch(base)
    assert match, f"not a Ray LLM image: {base}"
    assert match["ray_version"] == KubernetesSpec().ray_version, "render k8s would announce another Ray version"


def test_pdserve_is_installed_from_the_copied_project() -> None:
    copied = " ".join(arguments("COPY"))
    assert "pyproject.toml" in copied
    for package in sorted(path.parent.name for path in REPO.glob("pdserve*/__init__.py")):  # every one pip installs
        assert f"{package} /home/ray/pdserve/{package}" in copied, package
        assert f"!{package}/" in (REPO / ".dockerignore").read_text().splitlines(), package
    assert any(command.strip().endswith("/home/ray/pdserve") for command in pip_installs())


def installed_packages(command: str) -> list[str]:
    """The package names a ``pip install`` command names (not its paths, options or option values)."""
    tokens = command.split()[command.split().index("install") + 1:]
    values = {value for option, value in itertools.pairwise(tokens) if option in {"--constraint", "-c"}}
    names = [token for token in tokens if not token.startswith(("-", "/", ".")) and token not in values]
    return [re.split(r"[\[<>=!~ ()]", name, maxsplit=1)[0].lower() for name in names]


def test_no_pip_install_replaces_the_image_engines() -> None:
    """vLLM, torch and Ray come with the image, built for its CUDA: every install is pinned to them."""
    assert "pip list --format=freeze > /tmp/image-packages.txt" in " ".join(arguments("RUN"))
    for command in pip_installs():
        assert "--constraint /tmp/image-packages.txt" in command, command
        assert not {"vllm", "torch", "ray"} & set(installed_packages(command)), command


def test_no_secret_is_baked_in() -> None:
    for word, rest in instructions():
        if word in {"ENV", "ARG"}:
            assert not re.search(r"TOKEN|SECRET|PASSWORD|KEY", rest, re.IGNORECASE), rest


def test_the_documented_build_tag_is_the_default_image() -> None:
    assert f"docker build -t {KubernetesSpec().image} ." in (REPO / "Dockerfile").read_text()


def test_build_context_keeps_only_what_the_install_needs() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ignored[ignored.index("*") + 1:][:3] == ["!pyproject.toml", "!README.md", "!pdserve/"]
