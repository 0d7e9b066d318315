"""The DiffusionGemma family's studies: :mod:`.sft_throughput` (one training step, all response blocks in one pass
against TRL's one block per step, on one process and on a block-parallel group; the planner's projection of the
paper's setting)."""
