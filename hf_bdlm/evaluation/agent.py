"""mini-swe-agent in its text-based mode (actions in ```mswea_bash_command``` fences) against an OpenAI endpoint.

The agent and its prompts are mini-swe-agent's own: `swebench_backticks.yaml` for SWE-bench tasks,
`mini_textbased.yaml` for terminal tasks, with the working directory pointed at a local sandbox folder and the model
at our server through litellm (`openai/<model>` with `api_base`). Cost tracking is off (a local model has no price).

    from hf_bdlm.evaluation.agent import AgentSettings, run_agent
    outcome = run_agent("Fix the bug ...", "/tmp/sandbox/repo", AgentSettings("http://127.0.0.1:8000/v1", "m"))
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

# mini-swe-agent reads these at import time: no cost lookups for a local model, no banner, no setup wizard.
AGENT_ENV = {
    "MSWEA_COST_TRACKING": "ignore_errors",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "MSWEA_CONFIGURED": "true",
    "MSWEA_SILENT_STARTUP": "1",
    # A local server that answers 4xx/5xx will not do better after a minute of back-off.
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "2",
}
SWEBENCH_CONFIG = "swebench_backticks.yaml"
TERMINAL_CONFIG = "mini_textbased.yaml"


@dataclass
class AgentSettings:
    r"""
    Parameters:
        base_url (`str`): the OpenAI-compatible endpoint, e.g. `http://127.0.0.1:8000/v1`.
        model (`str`): the served model id.
        api_key (`str`, defaults to `"none"`): sent as the bearer token.
        step_limit (`int`, defaults to 20): most model calls per task.
        max_tokens (`int`, defaults to 512): completion budget of one model call.
        temperature (`float`, defaults to 0.0): sampling temperature (0: greedy).
        command_timeout_s (`int`, defaults to 60): limit of one shell command.
        wall_time_limit_s (`int`, defaults to 0): limit of one task (0: none).
        model_kwargs (`dict`): further litellm arguments (e.g. `extra_body` with block-diffusion knobs).
    """

    base_url: str
    model: str
    api_key: str = "none"
    step_limit: int = 20
    max_tokens: int = 512
    temperature: float = 0.0
    command_timeout_s: int = 60
    wall_time_limit_s: int = 0
    model_kwargs: dict = field(default_factory=dict)


@dataclass
class AgentOutcome:
    exit_status: str
    submission: str
    steps: int
    prompt_tokens: int
    completion_tokens: int
    wall_time_s: float
    trajectory: list[dict]


def prepare_environment() -> None:
    for key, value in AGENT_ENV.items():
        os.environ.setdefault(key, value)


def load_agent_config(name: str, cwd: str) -> dict:
    """mini-swe-agent's shipped config `name`, its container path `/testbed` replaced by the sandbox folder."""
    prepare_environment()
    # lazy: optional dependency (mini-swe-agent), after prepare_environment() sets what it reads
    from minisweagent.config import get_config_path

    text = get_config_path(name).read_text()
    return yaml.safe_load(text.replace("/testbed", cwd))


def run_agent(task: str, cwd: str | Path, settings: AgentSettings, config_name: str = SWEBENCH_CONFIG,
              trajectory_path: str | Path | None = None) -> AgentOutcome:
    """Run the agent on `task` with shell commands executed in `cwd`; never raises for the model's failures."""
    prepare_environment()
    # lazy: optional dependency (mini-swe-agent), after prepare_environment() sets what it reads
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    cwd = str(Path(cwd).resolve())
    config = load_agent_config(config_name, cwd)
    agent_config = {**config.get("agent", {}), "step_limit": settings.step_limit, "cost_limit": 0.0,
                    "wall_time_limit_seconds": settings.wall_time_limit_s,
                    "output_path": Path(trajectory_path) if trajectory_path else None}
    env_config = config.get("environment", {})
    environment = LocalEnvironment(cwd=cwd, timeout=settings.command_timeout_s, env=env_config.get("env", {}))
    model_config = {k: v for k, v in config.get("model", {}).items() if k not in ("model_name", "model_kwargs")}
    model = LitellmTextbasedModel(
        **model_config,
        model_name=f"openai/{settings.model}",
        model_kwargs={"api_base": settings.base_url, "api_key": settings.api_key, "max_tokens": settings.max_tokens,
                      "temperature": settings.temperature, "drop_params": True, **settings.model_kwargs},
        cost_tracking="ignore_errors",
    )
    agent = DefaultAgent(model, environment, **agent_config)
    start = time.perf_counter()
    try:
        info = agent.run(task)
        exit_status, submission = info.get("exit_status", ""), info.get("submission", "") or ""
    except Exception as err:  # the model server refused or failed: the task is simply not solved
        exit_status, submission = type(err).__name__, ""
    prompt_tokens, completion_tokens = _usage(agent.messages)
    return AgentOutcome(exit_status=exit_status, submission=submission, steps=agent.n_calls,
                        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        wall_time_s=time.perf_counter() - start, trajectory=agent.messages)


def _usage(messages: list[dict]) -> tuple[int, int]:
    """Summed `usage` of the server responses the agent stored with its messages (format errors included)."""
    prompt = completion = 0
    for message in messages:
        response = (message.get("extra") or {}).get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        if usage:
            prompt += int(usage.get("prompt_tokens") or 0)
            completion += int(usage.get("completion_tokens") or 0)
    return prompt, completion
