"""Code that vLLM engines load through their own extension points. This package imports nothing
of pdserve, and this file nothing of vLLM, so pdserve can name what it sets without loading vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # vLLM's OpenAI server, run as a module

# The per-deployment secret every engine pdserve launches requires: vLLM's API key on every HTTP route but /health
# (engine_key.py), and the key of its NIXL side channel (side_channel.py). Set by pdserve, never given to clients.
ENGINE_KEY_ENV = "PDSERVE_ENGINE_KEY"
# vLLM's ``--middleware`` for it, as vLLM names a class (module path, a dot, the class: serve/middleware/register.py).
ENGINE_KEY_MIDDLEWARE = "pdserve_vllm.engine_key.EngineKeyMiddleware"
ENGINE_KEY_MIN_CHARS = 16  # an engine refuses a shorter key: pdserve's own check (access.MIN_KEY_CHARS) is no laxer


class EngineKeyMissing(RuntimeError):
    """The engine was started without the deployment's engine key: it refuses to start rather than run open."""


def read_engine_key(environ: Mapping[str, str]) -> str:
    """The engine key in ``environ`` (ENGINE_KEY_ENV). Raises EngineKeyMissing, one line naming the variable and
    never its value, where it is unset or shorter than ENGINE_KEY_MIN_CHARS."""
    key = environ.get(ENGINE_KEY_ENV, "").strip()
    if len(key) < ENGINE_KEY_MIN_CHARS:
        raise EngineKeyMissing(f"pdserve: {ENGINE_KEY_ENV} is {'too short' if key else 'not set'}: this engine "
                               f"refuses to start without the deployment's engine key (at least "
                               f"{ENGINE_KEY_MIN_CHARS} characters), which only pdserve gives it")
    return key

# The pause of an engine's NIXL progress thread between rounds, in microseconds (nixl_progress.py).
PROGRESS_DELAY_ENV = "PDSERVE_NIXL_PROGRESS_DELAY_US"

# The logits processor that starts a request with a token it is given (first_token.py), as vLLM's
# ``--logits-processors`` names it, and the ``vllm_xargs`` key a request gives that token in.
FIRST_TOKEN_PROCESSOR = "pdserve_vllm.first_token:FirstTokenProcessor"
FIRST_TOKEN_ARG = "pdserve_first_token"

# A prefill leg's ``kv_transfer_params`` key asking a hybrid model's prefill engine to compute the whole prompt
# (hybrid_connector.py), and the key of its reply's that says it did (whole_prompt.py).
WHOLE_PROMPT_KEY = "pdserve_whole_prompt"
WHOLE_PROMPT_KEPT_KEY = "pdserve_whole_prompt_kept"

# A key of both legs' ``kv_transfer_params`` for a hybrid's handoff to a decode engine given the first token as output:
# the prefill engine keeps the whole prompt where the decode engine can undo its recompute of the prompt's last
# token, and the decode engine loads all of it and undoes that (restore_last.py).
RESTORE_LAST_KEY = "pdserve_restore_last"

# The key of a prefill reply's ``kv_transfer_params`` that carries a digest of each block it hands over, which the
# decode engine checks after its pull (kv_integrity.py); the gateway passes it on untouched and reads only whether it
# is there (pdserve/pd/kv_proof.py).
KV_DIGEST_KEY = "pdserve_kv_digest"
# Test-only: a file naming the fault an engine injects into its KV handoffs (fault_injection.py); unset, none is.
KV_FAULT_ENV = "PDSERVE_KV_FAULT_FILE"


def pause_progress_thread(bindings: Any, delay_us: int) -> None:
    """Every NIXL agent made through ``bindings`` (NIXL's compiled module, ``nixlBind`` in its
    Python API) from now on pauses ``delay_us`` between progress rounds; NIXL's own is 0."""
    make_agent = bindings.nixlAgent

    def agent_with_pause(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return make_agent(name, config)

    bindings.nixlAgent = agent_with_pause
