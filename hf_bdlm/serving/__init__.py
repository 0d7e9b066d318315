"""OpenAI-compatible serving of block diffusion LMs (FastAPI + uvicorn), with batched decoding.

    hf-bdlm serve path/to/bdlm --port 8000 --api-key secret        # the command line
    from hf_bdlm.serving import Engine, ServerConfig, ServerThread  # in Python (tests, evaluation)

Modules: `config` (limits), `protocol` (request/response shapes, errors), `scheduler` (bounded queue, batching
worker), `engine` (tokenization, decoding settings, one batch), `app` (routes), `server` (uvicorn runners).
Needs the `serve` extra: pip install "hf-bdlm[serve]".
"""

from .app import create_app
from .config import ServerConfig
from .engine import Engine
from .server import ServerThread, free_port, serve


__all__ = ["Engine", "ServerConfig", "ServerThread", "create_app", "free_port", "serve"]
