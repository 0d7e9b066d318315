"""Reinforcement learning of block-diffusion policies: `BDLMGRPOTrainer` / `BDLMGRPOConfig` (TRL's GRPO, rollouts by
the model family's serving decoder, per-token log-probabilities by a named estimator) and verifiable rewards, each a
TRL reward function (docs/rl.md).

    from hf_bdlm.rl import BDLMGRPOConfig, BDLMGRPOTrainer, arith_exact_match

Names load on first use (``estimators`` is imported by the decoding loop, which must not import TRL).
"""

from __future__ import annotations

import importlib

_NAMES = {
    "BDLMGRPOConfig": "config",
    "BDLMGRPOTrainer": "trainer",
    "arith_exact_match": "rewards",
    "code_execution": "rewards",
    "fast_apply_exact_match": "rewards",
    "fast_apply_ast_match": "rewards",
    "LOGP_ESTIMATORS": "estimators",
}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_NAMES)
