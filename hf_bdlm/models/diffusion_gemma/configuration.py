"""What hf_bdlm reads of a DiffusionGemma configuration (transformers' `DiffusionGemmaConfig`, used as it is), and the
training settings of its noise that every room of the family shares: the objective trains with them, the
likelihood scorer integrates over the same noise levels.

    from hf_bdlm.models.diffusion_gemma.configuration import DEFAULT_NOISE_EPS, MODEL_PREDICTION_TYPES
"""

from __future__ import annotations

# Training draws each canvas block's noise level t from U(eps, 1 - eps) by default (t = 0: clean, t = 1: uniform
# tokens); the likelihood scorer's lowest level t_min is the same eps.
DEFAULT_NOISE_EPS = 1e-4
# How the objective reads the decoder's distribution of a clean token (``model_prediction_type``).
MODEL_PREDICTION_TYPES = ("mean", "mean_loo")

