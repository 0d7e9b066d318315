"""The dflash family's inference: decoding, serving, likelihood and exports for engines."""
