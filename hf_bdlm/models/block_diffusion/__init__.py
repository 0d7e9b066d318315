"""The block-diffusion family (converted causal LMs): its `ModelFamily` (``family.py``) and model card (``card.py``).

The model, its configuration, generation and conversion are the package's public modules (`hf_bdlm.modeling`,
`hf_bdlm.configuration`, `hf_bdlm.generation`, `hf_bdlm.conversion`), which its remote code bundles.
"""
