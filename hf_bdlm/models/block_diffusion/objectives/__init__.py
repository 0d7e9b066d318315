"""The block-diffusion family's objectives: ``standard`` (BD3-LM) and ``fast_dllm_v2`` (AR -> BDLM conversion as in
Fast-dLLM v2, with its variant ``fast_dllm_v2_causal_clean``), on the contract of :mod:`hf_bdlm.objectives.base`."""
