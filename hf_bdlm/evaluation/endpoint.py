"""The model endpoint an evaluation talks to: an existing server (`--base-url`) or one started here.

    from hf_bdlm.evaluation.endpoint import model_endpoint
    with model_endpoint(model_dir="outputs/bdlm") as endpoint:     # starts hf-bdlm's server on a free port
        print(endpoint.base_url, endpoint.model)
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import httpx


@dataclass
class Endpoint:
    base_url: str
    model: str
    api_key: str = "none"


@contextlib.contextmanager
def model_endpoint(model_dir: str | None = None, base_url: str | None = None, model: str | None = None,
                   api_key: str | None = None, engine=None, max_batch_size: int = 8) -> Iterator[Endpoint]:
    """Point at `base_url`, or serve `engine` / the checkpoint in `model_dir` on 127.0.0.1 for the duration."""
    if base_url:
        yield Endpoint(base_url.rstrip("/"), model or _first_model(base_url, api_key), api_key or "none")
        return
    # lazy: optional dependency (fastapi, uvicorn: the serve extra)
    from ..serving import Engine, ServerConfig, ServerThread

    if engine is None:
        if not model_dir:
            raise ValueError("give a model folder to serve or the --base-url of a running server.")
        engine = Engine.from_pretrained(model_dir, name=model)
    with ServerThread(engine, ServerConfig(port=0, api_key=None, max_batch_size=max_batch_size)) as server:
        yield Endpoint(server.base_url, engine.name)


def _first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def docker_available() -> bool:
    """Whether a Docker daemon answers here (the official harnesses need one)."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
