"""SWE-bench and Terminal-Bench evaluation of served block-diffusion models."""
