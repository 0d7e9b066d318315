"""The model families hf_bdlm trains, one folder each.

- ``block_diffusion/``: causal LMs converted into block-diffusion models (`BlockDiffusionForMaskedLM`);
- ``diffusion_gemma/``: transformers' `DiffusionGemmaForBlockDiffusion`, fine-tuned as it is;
- ``dflash/``: DFlash / DFlash2 speculative drafters, trained on a frozen target's captured features.

The rest of the package finds a family through the registry (:mod:`hf_bdlm.protocols.registry`), never by importing
its folder; the registry's names are re-exported here for code written against ``hf_bdlm.models``::

    from hf_bdlm.models import family_for_config
    family_for_config(AutoConfig.from_pretrained(path)).name    # 'diffusion_gemma', 'dflash' or 'block_diffusion'
"""

from ..protocols.registry import (
    PLANNED_OBJECTIVES,
    REGISTRY,
    FamilyEntry,
    ModelFamily,
    all_objectives,
    converting_family,
    entry_for_model_type,
    export_format,
    export_formats,
    family_commands,
    family_for_config,
    family_for_model,
    family_for_model_type,
    family_for_objective,
    family_named,
    family_names,
    family_studies,
    get_objective,
)

__all__ = ["PLANNED_OBJECTIVES", "REGISTRY", "FamilyEntry", "ModelFamily", "all_objectives", "converting_family",
           "entry_for_model_type", "export_format", "export_formats", "family_commands", "family_for_config",
           "family_for_model", "family_for_model_type", "family_for_objective", "family_named", "family_names",
           "family_studies", "get_objective"]
