"""pdserve: one OpenAI-compatible endpoint over prefill/decode-disaggregated vLLM engines."""

from pdserve.config import Settings, load_settings
from pdserve.errors import PdserveError
from pdserve.gateway.app import build_app
from pdserve.role import Role

__all__ = ["PdserveError", "Role", "Settings", "build_app", "load_settings"]
