"""The diffusion_gemma family's inference: decoding, serving, likelihood and exports for engines."""
