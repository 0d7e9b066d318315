"""The block_diffusion family's inference: decoding, serving, likelihood and exports for engines."""
