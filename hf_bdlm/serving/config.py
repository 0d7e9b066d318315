"""`ServerConfig`: the server's address, key and limits in one dataclass (the `hf-bdlm serve` flags).

    from hf_bdlm.serving import ServerConfig
    config = ServerConfig(port=8001, api_key="secret", max_batch_size=8)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

API_KEY_ENV = "HF_BDLM_API_KEY"


@dataclass
class ServerConfig:
    r"""
    Parameters:
        host (`str`, defaults to `"127.0.0.1"`):
            Address to bind. The default is reachable from this machine only; `0.0.0.0` exposes the server.
        port (`int`, defaults to 8000):
            TCP port.
        api_key (`str`, *optional*):
            When set, every `/v1` request needs `Authorization: Bearer <key>` (else 401). Defaults to the
            `HF_BDLM_API_KEY` environment variable.
        max_batch_size (`int`, defaults to 8):
            Most requests decoded together in one batch.
        max_queue (`int`, defaults to 32):
            Most requests waiting for a batch; more are refused with 429.
        batch_wait_ms (`float`, defaults to 10):
            How long the worker waits after a request for others to join its batch.
        max_body_bytes (`int`, defaults to 4 MiB):
            Larger request bodies are refused with 413.
        max_prompt_tokens (`int`, *optional*):
            Longer prompts are refused with 400 (`context_length_exceeded`). Defaults to the model's context - 1.
        max_tokens_limit (`int`, defaults to 4096):
            Largest `max_tokens` a request may ask for (400 beyond).
        default_max_tokens (`int`, defaults to 1024):
            Budget of a request that sets no `max_tokens` (capped by the context left).
        shutdown_grace_s (`float`, defaults to 25):
            On SIGTERM (or Ctrl-C) the server stops accepting connections and lets the requests in flight finish for
            at most this many seconds, then cancels the rest and exits 0. Below Kubernetes' default
            `terminationGracePeriodSeconds` (30), so the pod exits before it would be killed.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default_factory=lambda: os.environ.get(API_KEY_ENV) or None)
    max_batch_size: int = 8
    max_queue: int = 32
    batch_wait_ms: float = 10.0
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int | None = None
    max_tokens_limit: int = 4096
    default_max_tokens: int = 1024
    shutdown_grace_s: float = 25.0

    def __post_init__(self):
        for name in ("max_batch_size", "max_queue", "max_body_bytes", "max_tokens_limit", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0 seconds, got {self.shutdown_grace_s}.")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must lie in [0, 65535], got {self.port}.")
