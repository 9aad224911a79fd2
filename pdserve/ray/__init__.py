"""pdserve on a Ray cluster. ``pdserve.ray:app`` is the Ray Serve application builder: write it
in a Serve config where ``ray.serve.llm:build_pd_openai_app`` would go, with pdserve's
configuration as its args (``pdserve render serve`` prints that config)."""

from pdserve.ray.app import app

__all__ = ["app"]
