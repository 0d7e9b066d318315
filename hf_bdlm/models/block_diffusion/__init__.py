"""The block-diffusion family (converted causal LMs): its configuration (``configuration.py``), model
(``modeling.py``), decoding (``generation/``), conversion of a causal LM (``conversion.py``), objectives
(``objectives/``: ``standard``, ``fast_dllm_v2``), `ModelFamily` (``family.py``), model card (``card.py``), serving
decoder, likelihood bound and SDAR export. The remote code bundles its configuration and modeling; users import the
public names from the package's face (``from hf_bdlm import BlockDiffusionForMaskedLM, convert_causal_lm``).
"""
