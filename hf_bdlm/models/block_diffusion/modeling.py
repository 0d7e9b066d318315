"""`BlockDiffusionForMaskedLM`: any transformers causal-LM backbone run as a block diffusion LM.

The backbone (e.g. `LlamaForCausalLM`) is built unmodified with ``attn_implementation="bdlm"``;
this wrapper feeds it rows (clean and noisy streams sharing RoPE positions) and a layout that
tells the attention function who may see whom. Tiny CPU example::

    from transformers import LlamaConfig
    from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
    cfg = BlockDiffusionConfig(backbone_config=LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64),
                               block_size=4, mask_token_id=63)
    model = BlockDiffusionForMaskedLM(cfg)
    x = torch.randint(0, 63, (1, 16)); x_t = x.masked_fill(torch.rand(1, 16) < 0.5, 63)
    logits = model(input_ids=x_t, clean_input_ids=x).logits      # [1, 16, 64]
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import ModelOutput

from ...attention import (
    ATTENTION_NAME,
    AttentionLayout,
    LocalLayout,
    MaskRule,
    check_block_aligned_documents,
    register_attention,
    vectorized_rows,
)
from ...attention.rows import document_positions
from ...checkpoints.files import check_weight_files
from .configuration import BlockDiffusionConfig
from .generation import BlockDiffusionGenerationMixin, generate


@dataclass
class BlockDiffusionOutput(ModelOutput):
    """
    Args:
        logits (`torch.FloatTensor`):
            Logits of the noisy stream: `[batch, L, vocab]`, or `[n, vocab]` for the positions selected by
            `logits_mask`.
        hidden_states (`torch.FloatTensor`):
            Last hidden states of all rows (`[batch, rows, hidden]`, noisy rows first in the training form).
        cache (`Cache`, *optional*):
            The KV cache, when `use_cache=True`.
    """

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    cache: object | None = None


class BlockDiffusionPreTrainedModel(PreTrainedModel):
    config_class = BlockDiffusionConfig
    base_model_prefix = "backbone"
    supports_gradient_checkpointing = True
    _supports_attention_backend = True
    _no_split_modules = []

    def _init_weights(self, module):
        # The backbone initialises its own modules; nothing here owns parameters of its own.
        if hasattr(self, "backbone") and module is not self:
            self.backbone._init_weights(module)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        # A weights file cut short or damaged: an error naming it and the fix, not safetensors' parse error.
        if pretrained_model_name_or_path is not None:
            check_weight_files(pretrained_model_name_or_path)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


class BlockDiffusionForMaskedLM(BlockDiffusionGenerationMixin, BlockDiffusionPreTrainedModel):
    """A block diffusion language model over a causal-LM backbone.

    Forward forms:

    - training (vectorized): `model(input_ids=x_t, clean_input_ids=x)` runs both streams at once
      (`2L` rows, shared position ids) and returns the noisy stream's logits;
    - rows: `model(input_ids=rows, position_ids=..., bdlm_layout=layout)` runs exactly the rows a
      layout describes (a rank's share under block parallelism, or a block over a KV cache);
    - generation: [`~BlockDiffusionForMaskedLM.generate`].
    """

    def __init__(self, config: BlockDiffusionConfig):
        super().__init__(config)
        if config.mask_token_id is None:
            raise ValueError(
                "BlockDiffusionConfig.mask_token_id is None: a block diffusion model needs a [MASK] token. "
                "Use hf_bdlm.convert_causal_lm(...) to add one to a causal LM, or set mask_token_id."
            )
        register_attention()
        # A private copy: the caller's causal-LM config must keep its own attention implementation.
        backbone_config = copy.deepcopy(config.backbone_config)
        config.backbone_config = backbone_config
        try:
            model_class = AutoModelForCausalLM._model_mapping[type(backbone_config)]
        except KeyError:
            raise ValueError(
                f"Backbone model_type {backbone_config.model_type!r} has no AutoModelForCausalLM class; "
                "block diffusion needs a causal-LM backbone (Llama, Qwen2/3, Gemma 3, Mistral, ...)."
            ) from None
        if not getattr(model_class, "_supports_attention_backend", False):
            raise ValueError(
                f"Backbone model_type {backbone_config.model_type!r} ({model_class.__name__}) does not call "
                "transformers' attention interface, so block-diffusion attention cannot be plugged in. "
                "Supported backbones include llama, qwen2, qwen3, gemma3_text and mistral."
            )
        backbone_config._attn_implementation = ATTENTION_NAME
        self.backbone = model_class._from_config(backbone_config, attn_implementation=ATTENTION_NAME)
        self.post_init()

    # --- transformers plumbing -------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Module:
        return self.backbone.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.backbone.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.backbone.get_output_embeddings()

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.backbone.set_output_embeddings(value)

    @property
    def decoder(self) -> nn.Module:
        """The backbone's base model (transformer layers without the LM head)."""
        return getattr(self.backbone, self.backbone.base_model_prefix)

    def mask_rule(self, block_size: int | None = None) -> MaskRule:
        """The attention rule of this model: training and `generate` use the same one.

        `block_size` overrides the config's (decoding in sub-blocks); the sliding-window layers add their window.
        """
        cfg = self.config
        return MaskRule(block_size or cfg.block_size, cfg.clean_attention,
                        window_convention=cfg.sliding_window_convention)

    # --- forward ---------------------------------------------------------------------------
    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the LM head (and the backbone's final logit soft-capping, if any)."""
        logits = self.get_output_embeddings()(hidden)
        cap = getattr(self.config.backbone_config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def run_rows(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor,
        layout: AttentionLayout,
        inputs_embeds: torch.Tensor | None = None,
        cache=None,
        use_cache: bool = False,
        **kwargs,
    ):
        """Run the backbone's layers over rows described by ``layout``; returns its base-model output."""
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        return self.decoder(
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            bdlm_layout=layout,
            **kwargs,
        )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        clean_input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        logits_mask: torch.Tensor | None = None,
        bdlm_layout: AttentionLayout | None = None,
        cache=None,
        use_cache: bool = False,
        return_logits: bool = True,
        **kwargs,
    ) -> BlockDiffusionOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `[batch, L]`):
                The noisy sequence `x_t` (training form), or the rows of `bdlm_layout` (rows form).
            clean_input_ids (`torch.LongTensor` of shape `[batch, L]`, *optional*):
                The clean sequence `x`; selects the training form.
            position_ids (`torch.LongTensor`, *optional*):
                RoPE positions. Training form: `[batch, L]`, shared by both streams (default: `0..L-1`, restarting
                per document when `document_ids` is given). Rows form: required, one per row.
            document_ids (`torch.LongTensor` of shape `[batch, L]`, *optional*):
                Packed-document ids, constant inside each block (documents aligned to block boundaries).
            logits_mask (`torch.BoolTensor` of shape `[batch, L]`, *optional*):
                Compute logits only at these noisy positions (saves the `[L, vocab]` logits of the rest).
            bdlm_layout (`AttentionLayout`, *optional*):
                Rows form: the layout describing `input_ids`' rows (see `hf_bdlm.parallel`).
            return_logits (`bool`, defaults to `True`):
                Set to `False` to get only `hidden_states` (objectives apply the head to the rows they supervise).
        """
        if clean_input_ids is None:
            if bdlm_layout is None:
                raise ValueError(
                    "BlockDiffusionForMaskedLM.forward needs the clean sequence: call model(input_ids=x_t, "
                    "clean_input_ids=x) to train, model.generate(...) to decode, or pass rows with a `bdlm_layout`."
                )
            if position_ids is None:
                raise ValueError("The rows form (bdlm_layout=...) needs the global `position_ids` of the rows.")
            if "past_key_values" in kwargs:  # the pre-5.23 name of `cache`
                cache = kwargs.pop("past_key_values")
            out = self.run_rows(input_ids, position_ids, bdlm_layout, cache=cache, use_cache=use_cache, **kwargs)
            hidden = out.last_hidden_state
            logits = None
            if return_logits:
                logits = self.lm_logits(hidden[logits_mask] if logits_mask is not None else hidden)
            return BlockDiffusionOutput(logits=logits, hidden_states=hidden, cache=out.cache)

        noisy, clean = input_ids, clean_input_ids
        self._check_training_inputs(noisy, clean, document_ids)
        batch, length = clean.shape
        if position_ids is None:
            if document_ids is not None:
                position_ids = document_positions(document_ids)
            else:
                position_ids = torch.arange(length, device=clean.device).expand(batch, length)
        rows = vectorized_rows(length, document_ids, device=clean.device)
        layout = bdlm_layout or LocalLayout(rows, rows, self.mask_rule(), self.config.attention_backend)
        out = self.run_rows(
            torch.cat([noisy, clean], dim=1), torch.cat([position_ids, position_ids], dim=1), layout, **kwargs
        )
        hidden = out.last_hidden_state
        noisy_hidden = hidden[:, :length]
        logits = None
        if return_logits:
            logits = self.lm_logits(noisy_hidden[logits_mask] if logits_mask is not None else noisy_hidden)
        return BlockDiffusionOutput(logits=logits, hidden_states=hidden)

    def _check_training_inputs(self, noisy, clean, document_ids) -> None:
        if noisy is None:
            raise ValueError("input_ids (the noisy sequence x_t) is required with clean_input_ids.")
        if noisy.shape != clean.shape:
            raise ValueError(
                f"input_ids {tuple(noisy.shape)} and clean_input_ids {tuple(clean.shape)} must have the same shape."
            )
        if noisy.dim() != 2 or noisy.shape[0] == 0 or noisy.shape[1] == 0:
            raise ValueError(f"expected a non-empty batch of shape [batch, L], got {tuple(noisy.shape)}.")
        block = self.config.block_size
        if clean.shape[1] % block:
            raise ValueError(
                f"sequence length {clean.shape[1]} is not a multiple of block_size={block}; pad it with "
                "hf_bdlm.pad_to_block_multiple (pad tokens are never supervised) instead of truncating."
            )
        self.config.check_token_ids(noisy, "input_ids")
        self.config.check_token_ids(clean, "clean_input_ids")
        if document_ids is not None:
            if document_ids.shape != clean.shape:
                raise ValueError(
                    f"document_ids {tuple(document_ids.shape)} must have the shape of the input {tuple(clean.shape)}."
                )
            check_block_aligned_documents(document_ids, block)

    # --- saving (hooks into hf_bdlm.hub; left out of the remote code, which transformers saves itself) --------
    def save_pretrained(self, save_directory, *args, **kwargs):
        """[`~PreTrainedModel.save_pretrained`], plus self-contained `configuration_block_diffusion.py` and
        `modeling_block_diffusion.py` and an `auto_map` in config.json, so that the folder also loads with
        `trust_remote_code=True` where hf_bdlm is not installed (see `hf_bdlm.hub.remote_code`)."""
        # lazy: a hub hook: the remote-code bundler leaves out the functions importing hf_bdlm.hub
        from ...hub.remote_code import save_with_remote_code

        return save_with_remote_code(self, super().save_pretrained, save_directory, *args, **kwargs)

    def push_to_hub(self, repo_id: str, *, tokenizer=None, card_info: dict | None = None, **kwargs):
        """Upload what [`hf_bdlm.hub.save_for_hub`] writes (weights, config, remote code, generation config, the
        model card, and the tokenizer when given) to `repo_id`; see [`hf_bdlm.hub.push_to_hub`]."""
        # lazy: a hub hook: the remote-code bundler leaves out the functions importing hf_bdlm.hub
        from ...hub import push_to_hub

        return push_to_hub(self, repo_id, tokenizer=tokenizer, info=card_info, **kwargs)

    def generate(self, input_ids: torch.Tensor, generation_config=None, **kwargs) -> torch.Tensor:
        """Block-wise diffusion decoding; see :func:`hf_bdlm.models.block_diffusion.generation.generate`."""
        if getattr(self.config, "bdlm_trained_steps", None) == 0 and not getattr(self, "_warned_untrained", False):
            self._warned_untrained = True
            warnings.warn(UNTRAINED_WARNING, UntrainedModelWarning, stacklevel=2)
        return generate(self, input_ids, generation_config=generation_config, **kwargs)


class UntrainedModelWarning(UserWarning):
    """Generation from a model converted from a causal LM and never trained as a block diffusion LM."""


UNTRAINED_WARNING = (
    "this model has not been trained as a block diffusion LM (config.bdlm_trained_steps == 0: converted from a causal "
    "LM by convert_causal_lm / hf-bdlm convert, never fine-tuned), so it does not denoise yet and generates blank or "
    "meaningless text; fine-tune it first (hf-bdlm train, docs/usage.md).")


def pad_to_block_multiple(ids: torch.Tensor, block_size: int, pad_token_id: int) -> torch.Tensor:
    """Right-pad ``ids [..., L]`` with ``pad_token_id`` to the next multiple of ``block_size``.

    The stated padding rule of the project: sequences are never truncated; pad tokens fill the
    last block and are never supervised.
    """
    extra = (-ids.shape[-1]) % block_size
    if extra == 0:
        return ids
    pad = ids.new_full((*ids.shape[:-1], extra), pad_token_id)
    return torch.cat([ids, pad], dim=-1)
