"""DFlash speculative drafters: a small block-diffusion model that, conditioned on a frozen target causal LM's hidden
states, proposes a block of next tokens in one forward; the target verifies the block, so decoding stays lossless.

- :mod:`.configuration`: `DFlashConfig` (its ``config.json`` is the folder vLLM and SGLang serve);
- :mod:`.modeling`: `DFlashDraftModel`, `DFlash2DraftModel` (the target's embedding and head bound, never saved),
  `DFlashContextCache` (decoding: each committed context row projected once);
- :mod:`.training.objectives`: the `dflash` objective: anchors, labels, position weights, the CE / KL / D-PACE
  losses, the dealing of anchors to ranks, and the objective as the trainer runs it;
- :mod:`.sharded`: the forward of one rank under ``cp`` / ``bp`` / ``csbp`` (context rows sharded, anchors dealt);
- :mod:`.trainer`, :mod:`.trainer_config`: `DFlashTrainer` (`BDLMSFTTrainer`'s machinery over captured features);
- :mod:`.capture`: the frozen target's features written once, read by token range;
- :mod:`.speculative`: lossless greedy decoding with a drafter (transformers' assisted generation, a batched loop);
- :mod:`.acceptance`: the acceptance serving reaches, replayed on held-out captured features (the trainer's eval);
- :mod:`.export`: the serving folder, its inventory check, ``push_to_hub``; :mod:`.commands`: ``hf-bdlm dflash``.

    from hf_bdlm.models.dflash import DFlash2DraftModel, speculative_generate
    drafter = DFlash2DraftModel.from_target(target, init="target_layers", num_hidden_layers=1, block_size=8)
    sequences, stats = speculative_generate(target, drafter, input_ids, max_new_tokens=64)
"""

import importlib

# Names and the module defining each, imported on first use (the `hf-bdlm dflash` parser loads no model code).
_EXPORTS = {
    "DFlashConfig": "configuration", "DFlashDraftModel": "modeling", "DFlash2DraftModel": "modeling",
    "DFlashContextCache": "modeling",
    "DFlashBatch": "training.objectives", "DFlashObjective": "training.objectives",
    "DFlashObjectiveConfig": "training.objectives", "DFlashTrainingObjective": "training.objectives",
    "DFlashShardPlan": "training.sharded", "sharded_draft_forward": "training.sharded",
    "DFlashTrainer": "training.trainer", "DFlashTrainingConfig": "training.config",
    "SpeculativeStats": "inference.speculative", "dflash_assisted_decoding": "inference.speculative",
    "speculative_generate": "inference.speculative", "replay_acceptance": "training.acceptance",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
