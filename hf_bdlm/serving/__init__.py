"""OpenAI-compatible serving of block diffusion LMs (FastAPI + uvicorn), with batched decoding.

    hf-bdlm serve path/to/bdlm --port 8000 --api-key secret        # the command line
    from hf_bdlm.serving import Engine, ServerConfig, ServerThread  # in Python (tests, evaluation)

Modules: `config` (limits), `protocol` (request/response shapes, errors), `scheduler` (bounded queue, batching
worker), `engine` (tokenization, decoding settings, one batch), `app` (routes), `server` (uvicorn runners).
Needs the `serve` extra: pip install "hf-bdlm[serve]".
"""

import importlib

# Names and the module defining each, imported on first use (the `hf-bdlm serve` parser loads no model code).
_EXPORTS = {"create_app": "app", "ServerConfig": "config", "Engine": "engine", "ServerThread": "server",
            "free_port": "server", "serve": "server"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
