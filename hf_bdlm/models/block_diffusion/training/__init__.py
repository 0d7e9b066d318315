"""The block_diffusion family's training: its trainer, objectives, sharded forward and what feeds them."""
