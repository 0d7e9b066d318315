"""`BlockDiffusionConfig`: a causal-LM backbone config plus the block-diffusion fields.

    >>> from transformers import LlamaConfig
    >>> from hf_bdlm import BlockDiffusionConfig
    >>> cfg = BlockDiffusionConfig(backbone_config=LlamaConfig(vocab_size=128), block_size=16, mask_token_id=127)
"""

from __future__ import annotations

from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

from ...protocols.diffusion_fields import CLEAN_ATTENTION_KINDS, WINDOW_CONVENTIONS, check_diffusion_fields

# The objectives a BlockDiffusionConfig trains (the block-diffusion family's; other families keep their own configs,
# and the objectives announced but not built yet are the registry's, hf_bdlm.protocols.registry.PLANNED_OBJECTIVES).
OBJECTIVES = ("standard", "fast_dllm_v2", "fast_dllm_v2_causal_clean")
# The clean stream an objective's reference trains (objectives absent here accept both kinds).
OBJECTIVE_CLEAN_ATTENTION = {
    "fast_dllm_v2": "block_causal",
    "fast_dllm_v2_causal_clean": "causal",
}


class BlockDiffusionConfig(PreTrainedConfig):
    r"""
    Configuration of a [`BlockDiffusionForMaskedLM`].

    Parameters:
        backbone_config (`dict` or `PreTrainedConfig`):
            Configuration of the causal-LM backbone (any `AutoModelForCausalLM` architecture that
            uses transformers' attention interface: Llama, Qwen2/3, Gemma 3, Mistral, ...).
        block_size (`int`, defaults to 32):
            Tokens per diffusion block. Sequences are denoised block by block.
        mask_token_id (`int`):
            Id of the absorbing `[MASK]` token; must lie inside the backbone's vocabulary. Required by the
            model (a config without it exists only as a template).
        clean_attention (`str`, *optional*):
            Attention among clean tokens: `"block_causal"` (a clean token sees its whole block and the earlier ones:
            BD3-LM and Fast-dLLM v2) or `"causal"` (token-causal, as the causal LM and
            `fast_dllm_v2_causal_clean`). Defaults to the objective's (`"block_causal"` for `"standard"`); an
            objective with a reference clean stream rejects the other kind.
        objective (`str`, defaults to `"standard"`):
            Default training objective: `"standard"` (BD3-LM), `"fast_dllm_v2"` (Fast-dLLM v2),
            `"fast_dllm_v2_causal_clean"` (its variant whose clean stream stays the causal LM).
        sliding_window_convention (`str`, *optional*):
            What a sliding window of width `W` means for a block of queries, on the backbone's sliding-window layers:
            `"per_query"` (every query sees keys within distance `W`, as in the causal LM; what `generate` has
            always applied) or `"block_start"` (a noisy block sees the `W - 1` clean positions before its start and
            its whole block, what a sliding cache holds, as Turbo-dLLM trains). Training and `generate` use
            the same one. Defaults to `"per_query"`. See
            `hf_bdlm.attention.masks`.
        noise_eps_min (`float`, defaults to 1e-3), noise_eps_max (`float`, defaults to 1.0):
            Range the per-block masking rate `t` is clipped to.
        loss_weighting (`str`, defaults to `"inverse_t"`):
            Weight of a masked token's cross-entropy: `"inverse_t"` (`1/t`, the ELBO) or `"unit"`.
        attention_backend (`str`, defaults to `"auto"`):
            `"auto"` (`"flex"` on CUDA tensors, `"blockwise"` elsewhere), `"dense"`, `"blockwise"` or `"flex"` (see
            `hf_bdlm.attention.backends`).
        bdlm_trained_steps (`int`, *optional*):
            Optimizer steps the model has been trained as a block diffusion LM: `0` when written by
            `convert_causal_lm` (the causal LM's weights, never trained to denoise: `generate` warns once), the
            trainer's step count when the trainer saves it, `None` (unknown) in checkpoints written before the field.
    """

    model_type = "block_diffusion"
    sub_configs_defaults = {"backbone_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    backbone_config: dict | PreTrainedConfig | None = None
    block_size: int = 32
    mask_token_id: int | None = None
    clean_attention: str | None = None
    objective: str = "standard"
    sliding_window_convention: str | None = None
    noise_eps_min: float = 1e-3
    noise_eps_max: float = 1.0
    loss_weighting: str = "inverse_t"
    attention_backend: str = "auto"
    bdlm_trained_steps: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.tie_word_embeddings = bool(getattr(self.backbone_config, "tie_word_embeddings", False))
        self.validate_diffusion_fields()

    @property
    def vocab_size(self) -> int:
        return self.backbone_config.vocab_size

    @property
    def max_position_embeddings(self) -> int | None:
        """The backbone's context length, where code written for a causal LM's config reads it (TRL's tool loop
        bounds a multi-turn rollout by ``model.config.max_position_embeddings``)."""
        return getattr(self.backbone_config, "max_position_embeddings", None)

    def get_text_config(self, decoder=None, encoder=None):
        return self.backbone_config

    def check_token_ids(self, ids, name: str = "input_ids") -> None:
        """Raise if ``ids`` holds ids outside the backbone vocabulary (a tokenizer/model mismatch)."""
        vocab = self.backbone_config.vocab_size
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(
                f"{name} holds token ids in [{low}, {high}] but the model vocabulary has {vocab} entries: the "
                "tokenizer and the model do not match (resize the embeddings, e.g. with hf_bdlm.convert_causal_lm)."
            )

    def validate_diffusion_fields(self) -> None:
        """Validate the diffusion fields (:func:`check_diffusion_fields`) and resolve the objective-dependent defaults."""
        check_diffusion_fields(block_size=self.block_size, mask_token_id=self.mask_token_id,
                               vocab_size=self.backbone_config.vocab_size, objective=self.objective,
                               objectives=OBJECTIVES, noise_eps_min=self.noise_eps_min, noise_eps_max=self.noise_eps_max,
                               attention_backend=self.attention_backend)
        # The config always holds a weighting (the standard objective's default), used by weighted objectives only.
        check_diffusion_fields(loss_weighting=self.loss_weighting)
        required = OBJECTIVE_CLEAN_ATTENTION.get(self.objective)
        if self.clean_attention is None:
            self.clean_attention = required or "block_causal"
        if self.clean_attention not in CLEAN_ATTENTION_KINDS:
            raise ValueError(f"clean_attention must be one of {CLEAN_ATTENTION_KINDS}, got {self.clean_attention!r}.")
        if required is not None and self.clean_attention != required:
            variants = [name for name, kind in OBJECTIVE_CLEAN_ATTENTION.items() if kind == self.clean_attention]
            raise ValueError(
                f"objective={self.objective!r} trains a {required!r} clean stream (its reference's), got "
                f"clean_attention={self.clean_attention!r}. Drop clean_attention (it follows the objective), or pick "
                f"an objective made for a {self.clean_attention!r} clean stream: {variants + ['standard']}."
            )
        if self.sliding_window_convention is None:
            self.sliding_window_convention = "per_query"  # what generate has always applied
        if self.sliding_window_convention not in WINDOW_CONVENTIONS:
            raise ValueError(
                f"sliding_window_convention must be one of {WINDOW_CONVENTIONS}, got "
                f"{self.sliding_window_convention!r}."
            )
