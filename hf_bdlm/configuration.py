"""`BlockDiffusionConfig`: a causal-LM backbone config plus the block-diffusion fields.

    >>> from transformers import LlamaConfig
    >>> from hf_bdlm import BlockDiffusionConfig
    >>> cfg = BlockDiffusionConfig(backbone_config=LlamaConfig(vocab_size=128), block_size=16, mask_token_id=127)
"""

from __future__ import annotations

from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

from .attention.backends import BACKENDS
from .attention.masks import CLEAN_ATTENTION_KINDS, WINDOW_CONVENTIONS

OBJECTIVES = ("standard", "fast_dllm_v2", "fast_dllm_v2_causal_clean", "diffusion_gemma", "dflash")
LOSS_WEIGHTINGS = ("inverse_t", "unit")
# The clean stream an objective's reference trains (objectives absent here accept both kinds).
OBJECTIVE_CLEAN_ATTENTION = {
    "fast_dllm_v2": "block_causal",
    "fast_dllm_v2_causal_clean": "causal",
    "diffusion_gemma": "causal",
}
# Objectives whose row i - 1 predicts token i (generate shifts its logits for them).
TOKEN_SHIFT_OBJECTIVES = ("fast_dllm_v2", "fast_dllm_v2_causal_clean")
# The sliding-window convention an objective's model runs at inference (others: "per_query", what hf_bdlm's generate
# has always applied).
OBJECTIVE_WINDOW_CONVENTION = {"diffusion_gemma": "block_start"}


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
            BD3-LM and Fast-dLLM v2) or `"causal"` (token-causal, as the causal LM: DiffusionGemma's encoder and
            `fast_dllm_v2_causal_clean`). Defaults to the objective's (`"block_causal"` for `"standard"`); an
            objective with a reference clean stream rejects the other kind.
        objective (`str`, defaults to `"standard"`):
            Default training objective: `"standard"` (BD3-LM), `"fast_dllm_v2"` (Fast-dLLM v2),
            `"fast_dllm_v2_causal_clean"` (its variant whose clean stream stays the causal LM), `"diffusion_gemma"`,
            `"dflash"`.
        sliding_window_convention (`str`, *optional*):
            What a sliding window of width `W` means for a block of queries, on the backbone's sliding-window layers:
            `"per_query"` (every query sees keys within distance `W`, as in the causal LM; what `generate` has
            always applied) or `"block_start"` (a noisy block sees the `W - 1` clean positions before its start and
            its whole block, what a sliding cache holds: DiffusionGemma, Turbo-dLLM). Training and `generate` use
            the same one. Defaults to the objective's (`"per_query"` except for `"diffusion_gemma"`). See
            `hf_bdlm.attention.masks`.
        noise_eps_min (`float`, defaults to 1e-3), noise_eps_max (`float`, defaults to 1.0):
            Range the per-block masking rate `t` is clipped to.
        loss_weighting (`str`, defaults to `"inverse_t"`):
            Weight of a masked token's cross-entropy: `"inverse_t"` (`1/t`, the ELBO) or `"unit"`.
        attention_backend (`str`, defaults to `"blockwise"`):
            `"dense"`, `"blockwise"`, `"flex"` or `"flash"` (see `hf_bdlm.attention.backends`).
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
    attention_backend: str = "blockwise"
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.tie_word_embeddings = bool(getattr(self.backbone_config, "tie_word_embeddings", False))
        self._check_diffusion_fields()

    @property
    def vocab_size(self) -> int:
        return self.backbone_config.vocab_size

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

    def _check_diffusion_fields(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}.")
        vocab = self.backbone_config.vocab_size
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < vocab:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the backbone vocabulary of size {vocab}; "
                "resize the embeddings to include the mask token first (convert_causal_lm does this)."
            )
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}.")
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
            self.sliding_window_convention = OBJECTIVE_WINDOW_CONVENTION.get(self.objective, "per_query")
        if self.sliding_window_convention not in WINDOW_CONVENTIONS:
            raise ValueError(
                f"sliding_window_convention must be one of {WINDOW_CONVENTIONS}, got "
                f"{self.sliding_window_convention!r}."
            )
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {self.loss_weighting!r}.")
        if not 0.0 < self.noise_eps_min <= self.noise_eps_max <= 1.0:
            raise ValueError(
                f"need 0 < noise_eps_min <= noise_eps_max <= 1, got noise_eps_min={self.noise_eps_min}, "
                f"noise_eps_max={self.noise_eps_max}."
            )
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}.")
