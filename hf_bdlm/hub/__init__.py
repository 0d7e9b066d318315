"""The Hub: model cards, self-contained remote code, uploads, and the complete folder of a block-diffusion model.

    from hf_bdlm.hub import save_for_hub, push_to_hub
    save_for_hub(model, tokenizer, "out", {"parallel": {"mode": "csbp", "P": 2, "C": 2, "transport": "allgather",
                                                        "world": 2}, "metrics": {"loss": 0.41}})
    # out/ loads with `import hf_bdlm; AutoModel.from_pretrained("out")`, and without hf_bdlm with
    # `AutoModel.from_pretrained("out", trust_remote_code=True)`.
    push_to_hub(model, "me/my-bdlm", tokenizer, info)   # the same files, uploaded in one commit

- `card.py`: the model card (`README.md`) of a saved folder, rendered by the model family that owns its
  `model_type` (each family's `card.py` and template under `hf_bdlm/models/`);
- `remote_code.py`: the bundler that writes `configuration_block_diffusion.py` / `modeling_block_diffusion.py`
  (called by `BlockDiffusionForMaskedLM.save_pretrained`);
- `upload.py`: `push_folder_to_hub` (any saved folder, any family; the exports upload through it), `folder_files`;
- `block_diffusion_folder.py`: `save_for_hub`, `push_to_hub`: a block-diffusion model's folder (weights, remote code,
  generation config, tokenizer, card), written or uploaded; a model of another family is refused;
- `exports.py`: what every family's export for a serving engine shares.

The checks of a model folder's files and the atomic saves of a training run are :mod:`hf_bdlm.checkpoints`'.
"""

from .card import render_model_card, write_model_card
from ..protocols.card_parts import CARD_INFO_KEYS, hub_repo_id
from .block_diffusion_folder import push_to_hub, save_for_hub
from .upload import folder_files, push_folder_to_hub
from .remote_code import AUTO_MAP, bundle_remote_code, write_remote_code

__all__ = [
    "AUTO_MAP",
    "CARD_INFO_KEYS",
    "hub_repo_id",
    "bundle_remote_code",
    "folder_files",
    "push_folder_to_hub",
    "push_to_hub",
    "render_model_card",
    "save_for_hub",
    "write_model_card",
    "write_remote_code",
]
