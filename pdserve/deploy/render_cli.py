"""``pdserve render``: print what a cluster runs (the Serve config, the Kubernetes manifests). No cluster calls."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from pdserve.cli_config import ConfigOption, exit_on_config_error, settings_or_exit
from pdserve.deploy.k8s import render_manifests, render_yaml, resource_ref, write_manifests
from pdserve.deploy.k8s_secrets import secrets_note
from pdserve.deploy.serve import serve_config_yaml
from pdserve.errors import ConfigError

render_app = typer.Typer(help="Print the Ray Serve config or the Kubernetes manifests for a config.",
                         no_args_is_help=True)


@render_app.command("serve")
def render_serve(config: ConfigOption = None) -> None:
    """The Serve config that `serve deploy` accepts; `render k8s` embeds it, fitted to the cluster."""
    sys.stdout.write(serve_config_yaml(settings_or_exit(config)))


@render_app.command("k8s")
def render_k8s(
    config: ConfigOption = None,
    out: Annotated[Path | None, typer.Option(help="Write one YAML file per object here; default: stdout.")] = None,
) -> None:
    """The NetworkPolicies, the KubeRay RayService, the gateway's Service, PodMonitors and Grafana dashboard, in
    apply order, and the Secrets the pods require (a comment atop the YAML; printed after the files with --out)."""
    settings = settings_or_exit(config)
    try:
        if out is None:
            sys.stdout.write(render_yaml(settings))
            return
        objects, paths = render_manifests(settings), write_manifests(settings, out)
    except ConfigError as exc:
        exit_on_config_error(exc)
    for obj, path in zip(objects, paths, strict=True):
        print(f"{resource_ref(obj)} rendered to {path}")
    print("\n".join(secrets_note(settings)))
