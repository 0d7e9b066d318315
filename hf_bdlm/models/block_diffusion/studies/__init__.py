"""The block-diffusion family's studies: :mod:`.mask_logit` (how often the [MASK] logit would win a serving engine's
argmax, and what the SDAR export's correction does)."""
