"""The model card of a block-diffusion checkpoint (a converted causal LM), rendered from the packaged template.

`hf_bdlm.hub.write_model_card` renders it for a ``block_diffusion`` config (see that function for the ``info`` dict).
"""

from __future__ import annotations

from pathlib import Path

from ...protocols.card_parts import (
    format_value,
    hub_repo_id,
    read_json,
    render_card_template,
    trained_card_values,
)
from ...version import __version__

TEMPLATE_FILE = "model_card.md"
# What each objective of this family trains, in the card's words.
OBJECTIVE_TEXT = {
    "standard": "BD3-LM, absorbing `[MASK]` noise with one masking rate `t` per block; the loss is the cross-entropy "
    "of the masked tokens",
    "fast_dllm_v2": "Fast-dLLM v2 (AR to block-diffusion conversion), token shift (the logit at position `i - 1` "
    "predicts token `i`, as in the causal LM), two complementary masks per sequence, unit weights, block-causal clean "
    "stream",
    "fast_dllm_v2_causal_clean": "Fast-dLLM v2 with the clean stream kept token-causal, identical to the source causal "
    "LM (its KV cache is the causal LM's own), a block's first token predicted by the clean row before it",
}

_WEIGHTINGS = {"inverse_t": "weighted by `1/t` (the ELBO)", "unit": "unit weights"}
CLEAN_ATTENTION = {
    "block_causal": "a clean token sees its whole block and every earlier block",
    "causal": "token-causal, a clean token sees itself and earlier tokens, as in the causal LM",
}
GENERATION_KNOBS = {
    "block_size": "tokens per decoding block; `None` = the model's `block_size`",
    "steps_per_block": "denoising steps per block; `None` = until the block is unmasked",
    "confidence_threshold": "unmask every position at least this confident in the same step (parallel decoding)",
    "token_shift": "logit `i - 1` predicts token `i`; `None` = follow the objective",
    "unmasking": "which positions a step fixes: `hf_bdlm`, or SGLang's / LMDeploy's rule (`docs/deploy.md`)",
    "max_new_tokens": "tokens to generate (default: one block)",
    "do_sample": "sample instead of taking the most likely token",
    "temperature": "sampling temperature",
    "top_k": "sampling: keep the k most likely tokens",
    "top_p": "sampling: nucleus probability mass",
    "eos_token_id": "generation stops after the block holding the first EOS",
    "pad_token_id": "fills rows that ended early",
}


def render_block_diffusion_card(directory: Path, config: dict, info: dict) -> str:
    """The card's text for a saved block-diffusion folder (``config``: its parsed ``config.json``; ``info`` checked)."""
    backbone = config.get("backbone_config") or {}
    generation = read_json(directory / "generation_config.json") or {}
    objective = info.get("objective", config.get("objective", "standard"))
    base_model = info.get("base_model") or hub_repo_id(backbone.get("_name_or_path"))
    model_type = backbone.get("model_type", "unknown")
    values = trained_card_values(
        directory, info, library_name="hf-bdlm", base_model=base_model, name_or_path=backbone.get("_name_or_path"),
        tags=["block-diffusion", "hf-bdlm", "diffusion-language-model", model_type, objective])
    values.update(
        hf_bdlm_version=__version__,
        block_size=config.get("block_size"),
        mask_token_id=config.get("mask_token_id"),
        attention_backend=config.get("attention_backend"),
        dtype=config.get("dtype") or "float32",
        backbone_text=_backbone_text(backbone),
        objective_text=_objective_text(objective, config.get("loss_weighting")),
        clean_attention_text=f"`{config.get('clean_attention')}` — "
        + CLEAN_ATTENTION.get(config.get("clean_attention"), "see hf_bdlm.attention.masks"),
        training_rows=[(k, format_value(v)) for k, v in (info.get("training") or {}).items()],
        example_max_new_tokens=generation.get("max_new_tokens") or 2 * int(config.get("block_size") or 32),
        example_threshold=generation.get("confidence_threshold") or 0.9,
        generation_rows=[
            (k, format_value(generation[k]) if k in generation else "default", meaning)
            for k, meaning in GENERATION_KNOBS.items()
        ],
    )
    return render_card_template(__package__, TEMPLATE_FILE, values)


# --- pieces ------------------------------------------------------------------------------------------


def _backbone_text(backbone: dict) -> str:
    architecture = (backbone.get("architectures") or [None])[0]
    parts = [f"`{backbone.get('model_type', 'unknown')}`" + (f" (`{architecture}`)" if architecture else "")]
    for key, label in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"), ("num_attention_heads", "heads"),
                       ("num_key_value_heads", "KV heads"), ("vocab_size", "vocabulary")):
        if backbone.get(key) is not None:
            parts.append(f"{backbone[key]} {label}")
    return ", ".join(parts)


def _objective_text(objective: str, weighting: str | None) -> str:
    text = f"`{objective}` — " + OBJECTIVE_TEXT.get(objective, "see hf_bdlm.models.block_diffusion.training.objectives")
    if objective == "standard" and weighting in _WEIGHTINGS:
        text += ", " + _WEIGHTINGS[weighting]
    return text
