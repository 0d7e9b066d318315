"""Block-wise diffusion decoding: a clean KV cache across blocks, parallel denoising inside a block.

The sequence is cut into absolute blocks (position ``i`` is in block ``i // B``). The prompt's
full blocks are run once as clean rows and cached. The current block is the prompt's tail (if
the prompt ends mid-block; never changed) followed by ``[MASK]`` tokens; each denoising step
runs it as noisy rows over the cache and unmasks the positions whose confidence reaches a
threshold (at least one). A finished block is appended to the cache as clean rows, and the
next block starts fully masked. Noisy K/V never enter the cache. Tiny CPU example::

    import torch
    from transformers import LlamaConfig
    from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
    from hf_bdlm.models.block_diffusion.generation import BlockDiffusionGenerationConfig, generate
    cfg = BlockDiffusionConfig(backbone_config=LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64),
                               block_size=4, mask_token_id=63)
    model = BlockDiffusionForMaskedLM(cfg).eval()
    out = generate(model, torch.tensor([[1, 2, 3, 4, 5, 6]]), max_new_tokens=10, confidence_threshold=0.9)

Batches: prompts of equal length decode together in lock step. Prompts of different lengths (a
left-padded batch, or :func:`decode_ragged`) also decode in one batch: each row is laid out in
common columns behind a whole number of padding *blocks*, so its blocks still start at its own
first token; padding columns are a separate document that the row never attends to, and RoPE
positions count from each row's first token. Rows that finish (EOS, their own token budget) leave
the batch. The output keeps HF's layout (input columns, then the generated tokens, right-padded
with ``pad_token_id``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ...attention import CLEAN, NOISY, LocalLayout, MaskRule, RowMeta
from ...attention.rows import stream_rows
from ...protocols.diffusion_fields import TOKEN_SHIFT_OBJECTIVES

BLOCK_DIFFUSION_FIELDS = ("block_size", "steps_per_block", "confidence_threshold", "mask_token_id", "token_shift",
                          "unmasking")
# How a denoising step picks the positions it unmasks: this project's rule, and the rules of the serving engines an
# exported model runs in (docs/deploy.md), so that what is evaluated here is what they serve.
UNMASKING_STRATEGIES = ("hf_bdlm", "sglang_low_confidence", "lmdeploy_low_confidence_dynamic")
# The engines' thresholds when their launch sets none: SGLang 0.5.23 `srt/dllm/algorithm/low_confidence.py` line 17
# (`threshold` of --dllm-algorithm-config), LMDeploy 0.18.0 `pytorch/config.py` line 655 (--dllm-confidence-threshold).
ENGINE_DEFAULT_THRESHOLDS = {"sglang_low_confidence": 0.95, "lmdeploy_low_confidence_dynamic": 0.85}


class BlockDiffusionGenerationConfig(GenerationConfig):
    r"""
    A [`~transformers.GenerationConfig`] with the knobs of block-wise diffusion decoding. It is saved beside the
    model as `generation_config.json` and loaded back by `from_pretrained`.

    Parameters:
        block_size (`int`, *optional*):
            Tokens per decoding block. `None` uses the model's `config.block_size` (the block size it was trained
            with); a smaller value decodes in sub-blocks.
        steps_per_block (`int`, *optional*):
            Denoising steps per block. `None` runs until every position of the block is unmasked (each step unmasks
            the confident positions, at least one); an integer unmasks enough positions per step to finish the
            block in that many steps.
        confidence_threshold (`float`, *optional*, defaults to 0.9):
            Positions whose chosen token has at least this probability are unmasked in the same step (parallel
            decoding). `None` unmasks only the single most confident position per step (or the number
            `steps_per_block` requires).
        mask_token_id (`int`, *optional*):
            The `[MASK]` token; `None` uses the model's `config.mask_token_id`.
        token_shift (`bool`, *optional*):
            Whether the logit at position `i - 1` predicts token `i` (models trained with the `fast_dllm_v2` or
            `fast_dllm_v2_causal_clean` objective, e.g. converted causal LMs). `None` follows
            `model.config.objective`. With a shift, the first position of a block is predicted by the clean stream's
            last row (the finished previous block, as in Fast-dLLM v2's decoding; with a token-causal clean stream,
            the causal LM's own next-token prediction) and is unmasked in the block's first step.
        unmasking (`str`, *optional*, defaults to `"hf_bdlm"`):
            Which positions a denoising step fixes, and from which vocabulary:

            - `"hf_bdlm"`: the chosen token is the most probable one (or a sample) with `[MASK]` left out, as the
              `standard` objective's softmax leaves it out; every position with confidence `>=
              confidence_threshold` is fixed, at least the most confident one (or as many as `steps_per_block`
              needs).
            - `"sglang_low_confidence"`: SGLang's `LowConfidence` (`srt/dllm/algorithm/low_confidence.py`): the
              argmax and its softmax probability over the whole vocabulary, `[MASK]` included; every position with
              confidence strictly `>` the threshold, else the single most confident one; a position whose argmax is
              `[MASK]` stays masked (a step that changes nothing ends the block with its masks). Greedy only.
              `confidence_threshold=None` takes SGLang's default, 0.95.
            - `"lmdeploy_low_confidence_dynamic"`: LMDeploy's `low_confidence_dynamic`
              (`pytorch/strategies/dllm/unmasking.py`): the sampler's token over the whole vocabulary, `[MASK]`
              included, scored by its probability under the temperature-scaled softmax; the most confident position
              and every one with confidence `>=` the threshold; a `[MASK]` token is kept as a token.
              `confidence_threshold=None` takes LMDeploy's default, 0.85.

            The engine rules need a model without token shift (`objective="standard"`) and take no
            `steps_per_block`, `sub_block_size`, `block_cache` or `min_tokens_per_step` (the engines have none).
        min_tokens_per_step (`int`, *optional*, defaults to 1):
            The fewest positions a step fixes: the threshold's confident positions, but at least this many (the most
            confident first). 1 is the plain threshold rule.
        sub_block_size (`int`, *optional*):
            Unmask each block sub-block by sub-block, left to right (Fast-dLLM v2's small blocks): a step fixes only
            positions of the first sub-block that still holds a masked one. It must divide the block size. `None`:
            the whole block is one sub-block.
        block_cache (`bool`, *optional*, defaults to `False`):
            Fast-dLLM v2's sub-block cache: the first step of each sub-block runs the whole block and keeps the
            block's own K/V; the following steps of that sub-block run only its rows (and, with token shift, the row
            before it), attending to the clean prefix and to the kept K/V of the block's other rows. An
            approximation (those rows' K/V are not refreshed until the next sub-block starts); needs `sub_block_size`
            smaller than the block and `use_cache=True`.
        fuse_block_commit (`bool`, *optional*, defaults to `True`):
            Run the clean rows of a finished block (and the prompt's whole blocks) in the same forward as the first
            step of the next block, instead of a forward of their own. The same computation (the first step never
            reads the finished block's noisy rows), one forward fewer per block.
        eos_early_exit (`bool`, *optional*, defaults to `True`):
            A row is done with its block as soon as an EOS is fixed with no masked position before it: the positions
            after it are never decoded (they are cut from the output anyway). The output does not change.
        compact_batch (`bool`, *optional*, defaults to `True`):
            Each step runs only the rows of the batch that still have positions to fix; rows done with the block sit
            out the slower rows' steps instead of being recomputed with them. The output does not change.

    The usual fields apply: `max_new_tokens` (default: one block), `do_sample`, `temperature`, `top_k`, `top_p`,
    `eos_token_id` (int or list), `pad_token_id` (default: the first EOS id).
    """

    def __init__(
        self,
        block_size: int | None = None,
        steps_per_block: int | None = None,
        confidence_threshold: float | None = 0.9,
        mask_token_id: int | None = None,
        token_shift: bool | None = None,
        unmasking: str = "hf_bdlm",
        min_tokens_per_step: int = 1,
        sub_block_size: int | None = None,
        block_cache: bool = False,
        fuse_block_commit: bool = True,
        eos_early_exit: bool = True,
        compact_batch: bool = True,
        **kwargs,
    ):
        # Set before GenerationConfig.__init__, which ends by calling validate().
        self.block_size = block_size
        self.steps_per_block = steps_per_block
        self.confidence_threshold = confidence_threshold
        self.mask_token_id = mask_token_id
        self.token_shift = token_shift
        self.unmasking = unmasking
        self.min_tokens_per_step = min_tokens_per_step
        self.sub_block_size = sub_block_size
        self.block_cache = block_cache
        self.fuse_block_commit = fuse_block_commit
        self.eos_early_exit = eos_early_exit
        self.compact_batch = compact_batch
        super().__init__(**kwargs)

    @classmethod
    def from_model_config(cls, model_config) -> "BlockDiffusionGenerationConfig":
        # transformers' version compares every attribute with a plain GenerationConfig's, which lacks ours; take
        # its result (special tokens from the backbone) and add the mask token. `block_size` stays None ("the
        # model's") rather than a copy, so a later change of the model's block size is not silently ignored.
        base = GenerationConfig.from_model_config(model_config)
        config = cls(**base.to_dict())
        config.mask_token_id = getattr(model_config, "mask_token_id", None)
        config._original_object_hash = hash(config)
        return config

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None) -> None:
        super().validate(strict=strict, user_set_attributes=user_set_attributes)
        for name in ("block_size", "steps_per_block", "sub_block_size"):
            value = getattr(self, name, None)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")
        least = getattr(self, "min_tokens_per_step", 1)
        if not isinstance(least, int) or isinstance(least, bool) or least < 1:
            raise ValueError(f"min_tokens_per_step must be an integer >= 1, got {least!r}.")
        for name in ("block_cache", "fuse_block_commit", "eos_early_exit", "compact_batch"):
            value = getattr(self, name, None)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}.")
        threshold = getattr(self, "confidence_threshold", None)
        if threshold is not None and not 0.0 < threshold <= 1.0:
            raise ValueError(f"confidence_threshold must lie in (0, 1] or be None, got {threshold!r}.")
        mask = getattr(self, "mask_token_id", None)
        if mask is not None and (not isinstance(mask, int) or mask < 0):
            raise ValueError(f"mask_token_id must be a non-negative integer or None, got {mask!r}.")
        unmasking = getattr(self, "unmasking", "hf_bdlm")
        if unmasking not in UNMASKING_STRATEGIES:
            raise ValueError(f"unmasking must be one of {UNMASKING_STRATEGIES}, got {unmasking!r}.")


class BlockDiffusionGenerationMixin:
    """transformers hooks that make a block-diffusion model own a [`BlockDiffusionGenerationConfig`].

    `PreTrainedModel` creates `model.generation_config`, writes `generation_config.json` in `save_pretrained` and
    reads it in `from_pretrained` only when `can_generate()` is true, which needs `GenerationMixin` (the autoregressive
    loop, not ours). This mixin supplies the three hooks instead; it must come before `PreTrainedModel` in the bases
    so that its `generation_config_class` wins.
    """

    generation_config_class = BlockDiffusionGenerationConfig

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def adjust_generation_fn(
        self, generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path, **kwargs
    ) -> None:
        """Called by `from_pretrained`: load `generation_config.json` (or keep the one made from the model config)."""
        if generation_config is not None:
            self.generation_config = as_block_diffusion_config(generation_config)
            return
        if pretrained_model_name_or_path is None:
            return
        hub_keys = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
        load_kwargs = {k: kwargs[k] for k in hub_keys if kwargs.get(k) is not None}
        try:
            self.generation_config = BlockDiffusionGenerationConfig.from_pretrained(
                pretrained_model_name_or_path, _from_auto=from_auto_class, _from_pipeline=from_pipeline, **load_kwargs
            )
        except OSError:
            pass  # no generation_config.json: keep the config PreTrainedModel built from the model config


def as_block_diffusion_config(config: GenerationConfig | dict | None) -> BlockDiffusionGenerationConfig:
    """A copy of ``config`` as a [`BlockDiffusionGenerationConfig`] (plain `GenerationConfig`s are converted)."""
    if config is None:
        return BlockDiffusionGenerationConfig()
    if isinstance(config, dict):
        return BlockDiffusionGenerationConfig.from_dict(config)
    if isinstance(config, BlockDiffusionGenerationConfig):
        return copy.deepcopy(config)
    return BlockDiffusionGenerationConfig.from_dict(config.to_dict())


# --- resolved settings -----------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeSettings:
    """Everything one decoding run needs, with the model's defaults filled in."""

    block_size: int
    mask_token_id: int
    max_new_tokens: int
    steps_per_block: int | None
    confidence_threshold: float | None
    token_shift: bool
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    rule: MaskRule
    backend: str
    unmasking: str = "hf_bdlm"
    min_tokens_per_step: int = 1
    sub_block_size: int | None = None
    block_cache: bool = False
    fuse_block_commit: bool = True
    eos_early_exit: bool = True
    compact_batch: bool = True


def resolve_settings(model, config: BlockDiffusionGenerationConfig, prompt_len: int) -> DecodeSettings:
    model_config = model.config
    vocab = model_config.backbone_config.vocab_size
    mask = config.mask_token_id if config.mask_token_id is not None else model_config.mask_token_id
    if mask is None:
        raise ValueError(
            "No mask token id: set generation_config.mask_token_id or model.config.mask_token_id (convert_causal_lm "
            "adds a [MASK] token to a causal LM)."
        )
    if not 0 <= mask < vocab:
        raise ValueError(f"mask_token_id={mask} is outside the model vocabulary of size {vocab}.")
    block = config.block_size or model_config.block_size
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    elif config.max_length is not None:
        max_new = config.max_length - prompt_len
    else:
        max_new = block
    if max_new <= 0:
        raise ValueError(
            f"nothing to generate: max_new_tokens={config.max_new_tokens}, max_length={config.max_length}, "
            f"prompt length {prompt_len}; set max_new_tokens to a positive integer."
        )
    eos = config.eos_token_id
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    pad = config.pad_token_id if config.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    shift = config.token_shift if config.token_shift is not None else model_config.objective in TOKEN_SHIFT_OBJECTIVES
    unmasking = getattr(config, "unmasking", "hf_bdlm")
    threshold = config.confidence_threshold
    if unmasking != "hf_bdlm":
        _check_engine_rule(unmasking, bool(shift), config)
        threshold = ENGINE_DEFAULT_THRESHOLDS[unmasking] if threshold is None else threshold
    sub_block = _check_sub_blocks(block, config)
    return DecodeSettings(
        block_size=block,
        mask_token_id=int(mask),
        max_new_tokens=int(max_new),
        steps_per_block=config.steps_per_block,
        confidence_threshold=threshold,
        token_shift=bool(shift),
        # Unset sampling knobs take transformers' defaults (temperature 1, top_k 50, top_p 1).
        do_sample=bool(config.do_sample),
        temperature=1.0 if config.temperature is None else float(config.temperature),
        top_k=50 if config.top_k is None else config.top_k,
        top_p=1.0 if config.top_p is None else float(config.top_p),
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        rule=model.mask_rule(block),  # the training rule, sliding-window convention included
        backend=model_config.attention_backend,
        unmasking=unmasking,
        min_tokens_per_step=int(getattr(config, "min_tokens_per_step", 1)),
        sub_block_size=sub_block,
        block_cache=bool(getattr(config, "block_cache", False)),
        fuse_block_commit=bool(getattr(config, "fuse_block_commit", True)),
        eos_early_exit=bool(getattr(config, "eos_early_exit", True)),
        compact_batch=bool(getattr(config, "compact_batch", True)),
    )


def _check_sub_blocks(block: int, config: BlockDiffusionGenerationConfig) -> int | None:
    """The sub-block size of a decoding run (``None``: the whole block), refusing settings it cannot honour."""
    sub = getattr(config, "sub_block_size", None)
    if sub is not None and block % sub:
        raise ValueError(f"sub_block_size={sub} does not divide the block size {block}; pick a divisor of it "
                         "(e.g. block_size // 4).")
    if sub is not None and config.steps_per_block is not None:
        raise ValueError(f"steps_per_block={config.steps_per_block} fixes the steps of a whole block and "
                         f"sub_block_size={sub} decodes it sub-block by sub-block; set one of them (with sub-blocks, "
                         "confidence_threshold and min_tokens_per_step set how many positions a step fixes).")
    if getattr(config, "block_cache", False) and (sub is None or sub >= block):
        raise ValueError(f"block_cache=True keeps a block's K/V across the steps of a sub-block, so it needs a "
                         f"sub_block_size smaller than the block ({block}), got {sub}.")
    return sub if sub is not None and sub < block else None


def _check_engine_rule(unmasking: str, token_shift: bool, config: BlockDiffusionGenerationConfig) -> None:
    """Refuse settings an engine's unmasking rule has no counterpart for (they would not decode what it serves)."""
    if token_shift:
        raise ValueError(
            f"unmasking={unmasking!r} decodes without token shift (the logit at position i predicts token i, as the "
            "engines serve SDAR models), but this model predicts the next token (a fast_dllm_v2 objective, or "
            "token_shift=True): use unmasking='hf_bdlm', or a model trained with objective='standard'."
        )
    if config.steps_per_block is not None:
        raise ValueError(f"unmasking={unmasking!r} has no fixed number of steps per block; leave steps_per_block "
                         f"unset (got {config.steps_per_block}).")
    for name, plain in (("sub_block_size", None), ("block_cache", False), ("min_tokens_per_step", 1)):
        if getattr(config, name, plain) != plain:
            raise ValueError(f"unmasking={unmasking!r} decodes as the engine serves, which has no {name}; leave it "
                             f"at {plain} (got {getattr(config, name)!r}).")
    if unmasking == "sglang_low_confidence" and config.do_sample:
        raise ValueError("unmasking='sglang_low_confidence' is greedy (SGLang's LowConfidence always takes the "
                         "argmax and ignores sampling parameters); set do_sample=False.")


# --- the clean context: cached or recomputed ---------------------------------------------------


@dataclass(frozen=True)
class LeftPadding:
    """A ragged batch in common columns: row ``i`` starts after ``pad[i]`` padding columns (a multiple of the block
    size, so each row's blocks start at its own first token). Padding is document 0, the row's tokens document 1."""

    pad: torch.Tensor  # [batch]

    def doc(self, columns: torch.Tensor) -> torch.Tensor:
        return (columns[None] >= self.pad[:, None]).long()

    def position_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """RoPE positions counted from each row's first token (what the row would get decoded alone)."""
        return (columns[None] - self.pad[:, None]).clamp(min=0)

    def select(self, index: torch.Tensor) -> "LeftPadding":
        return LeftPadding(self.pad[index])


def _rows(stream: int, start: int, end: int, device, padding: LeftPadding | None) -> RowMeta:
    pos = torch.arange(start, end, device=device)
    return stream_rows(stream, pos, None if padding is None else padding.doc(pos))


def _run_rows(model, ids, q_rows, k_rows, settings, cache=None, padding: LeftPadding | None = None):
    """Hidden states of ``ids`` (rows ``q_rows``) attending to ``k_rows`` (the cache's rows, then ``q_rows``)."""
    if padding is None:
        positions = q_rows.pos[None].expand(ids.shape[0], -1)
    else:
        positions = padding.position_ids(q_rows.pos)
    backend = settings.backend
    if padding is not None and backend in ("auto", "blockwise") and ids.shape[1] <= 2 * settings.block_size:
        # A ragged batch's block step (with a committed block at most): rows differ in padding, so the block-sparse
        # planner would plan (and run) every row apart; the rule's dense mask over a few rows serves the batch at once.
        backend = "dense"
    layout = LocalLayout(q_rows, k_rows, settings.rule, backend)
    out = model(
        input_ids=ids,
        position_ids=positions,
        bdlm_layout=layout,
        past_key_values=cache,
        use_cache=cache is not None,
        return_logits=False,
    )
    return out.hidden_states


@dataclass(frozen=True)
class StepWindow:
    """The block positions one denoising forward runs, ``[lo, hi)`` for every row in it, and the part of them each row
    takes as it is: row ``r`` uses the K/V of ``[own_lo[r], own_hi[r])`` computed in this forward, and for the block's
    other positions the K/V its previous forward of the block left (the block cache). Without the block cache every
    row's window is the whole block."""

    lo: int
    hi: int
    own_lo: torch.Tensor  # [rows]
    own_hi: torch.Tensor  # [rows]

    @classmethod
    def whole(cls, rows: int, block_size: int, device) -> "StepWindow":
        return cls(0, block_size, torch.zeros(rows, dtype=torch.long, device=device),
                   torch.full((rows,), block_size, dtype=torch.long, device=device))


@dataclass(frozen=True)
class _StepPlan:
    """How :class:`DecodingCache` treats the K/V of one denoising forward (its input: ``clean`` clean rows to commit,
    then the noisy rows of ``window``)."""

    clean: int
    rows: torch.Tensor | None  # the batch rows in the forward (None: all)
    window: StepWindow
    block_cache: bool
    batch: int
    block_size: int


class DecodingCache(DynamicCache):
    """The clean prefix's K/V (a `DynamicCache`: clean rows are appended) and the current block's K/V.

    A denoising forward sets :attr:`plan`; the backbone's attention layers then call :meth:`update` with the K/V of the
    forward's input: ``plan.clean`` clean rows (a finished block committed in this forward) are appended to the prefix,
    and the noisy rows are returned after it but never stored in it. With the block cache they are merged into the
    block's kept K/V (each row takes its own window fresh, the rest kept) and kept for the next step. The layout the
    forward runs with describes the returned keys: the prefix rows, then the whole block (or the window alone without
    the block cache, where the window is the whole block)."""

    def __init__(self):
        # No config, so every layer keeps all its keys: transformers' sliding-window layers keep only the last
        # W - 1 keys (enough for one new token, not for a block whose first query looks W - 1 back) and refuse
        # the per-step crop once full. The attention rule applies the window instead, in the model's convention.
        super().__init__()
        self.plan: _StepPlan | None = None
        self.block_kv: dict[int, list[torch.Tensor]] = {}  # layer -> [keys, values], each [batch, H_kv, B, d]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        plan = self.plan
        if plan is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        n = plan.clean
        if n:
            keys, values = super().update(key_states[:, :, :n], value_states[:, :, :n], layer_idx, *args, **kwargs)
        else:
            keys, values = self._prefix(layer_idx, plan.rows, key_states)
        new_keys, new_values = key_states[:, :, n:], value_states[:, :, n:]
        if plan.block_cache:
            new_keys = self._merge(layer_idx, 0, new_keys, plan)
            new_values = self._merge(layer_idx, 1, new_values, plan)
        return torch.cat([keys, new_keys], dim=-2), torch.cat([values, new_values], dim=-2)

    def _prefix(self, layer_idx: int, rows, like: torch.Tensor):
        if layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized or \
                self.layers[layer_idx].get_seq_length() == 0:
            empty = like.new_zeros((like.shape[0], like.shape[1], 0, like.shape[3]))
            return empty, empty
        layer = self.layers[layer_idx]
        if rows is None:
            return layer.keys, layer.values
        return layer.keys[rows], layer.values[rows]

    def _merge(self, layer_idx: int, which: int, fresh: torch.Tensor, plan: _StepPlan) -> torch.Tensor:
        """The block's K (``which`` 0) or V (1) for the forward's rows: this forward's inside each row's own window,
        the kept ones elsewhere; kept for the next step."""
        window = plan.window
        kept = self.block_kv.get(layer_idx)
        if kept is None:
            shape = (plan.batch, fresh.shape[1], plan.block_size, fresh.shape[3])
            kept = self.block_kv[layer_idx] = [fresh.new_zeros(shape), fresh.new_zeros(shape)]
        block = kept[which] if plan.rows is None else kept[which][plan.rows]
        block = block.clone() if plan.rows is None else block
        columns = torch.arange(window.lo, window.hi, device=fresh.device)
        own = (columns[None] >= window.own_lo[:, None]) & (columns[None] < window.own_hi[:, None])
        block[:, :, window.lo:window.hi] = torch.where(own[:, None, :, None], fresh, block[:, :, window.lo:window.hi])
        if plan.rows is None:
            kept[which] = block
        else:
            kept[which][plan.rows] = block
        return block

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        for kept in self.block_kv.values():
            kept[0], kept[1] = kept[0][indices], kept[1][indices]


class CachedContext:
    """Clean prefix held as K/V in a :class:`DecodingCache`; noisy steps run over it and never enter it.

    With ``settings.fuse_block_commit`` the clean rows appended (the prompt's whole blocks, a finished block) wait
    for the next denoising forward and run in it, before the block's noisy rows."""

    def __init__(self, model, settings: DecodeSettings, device, padding: LeftPadding | None = None):
        self.model, self.settings, self.device, self.padding = model, settings, device, padding
        self.cache = DecodingCache()
        self.length = 0  # clean columns in the cache
        self.pending: torch.Tensor | None = None  # clean ids appended, not run yet
        self.last_hidden = None  # clean hidden state of the last cached position (token shift)

    def _cached_rows(self, end: int | None = None) -> RowMeta:
        return _rows(CLEAN, 0, self.length if end is None else end, self.device, self.padding)

    def append(self, ids: torch.Tensor) -> None:
        if self.settings.fuse_block_commit:
            self.pending = ids if self.pending is None else torch.cat([self.pending, ids], dim=1)
            return
        q_rows = _rows(CLEAN, self.length, self.length + ids.shape[1], self.device, self.padding)
        k_rows = RowMeta.cat([self._cached_rows(), q_rows]) if self.length else q_rows
        hidden = _run_rows(self.model, ids, q_rows, k_rows, self.settings, self.cache, self.padding)
        self.length += ids.shape[1]
        self.last_hidden = hidden[:, -1]

    def step(self, block: torch.Tensor, start: int, rows: torch.Tensor | None, window: StepWindow):
        """One denoising forward of block positions ``window.lo .. window.hi`` of the batch rows ``rows`` (``None``:
        all) of ``block`` (``[batch, B]``, the whole batch's ids); returns their hidden states ``[rows, hi - lo, d]``
        and the clean hidden state of the position before the block (``None`` when there is none)."""
        settings, (batch, B) = self.settings, block.shape
        clean = 0 if self.pending is None else self.pending.shape[1]
        if clean and rows is not None:
            raise RuntimeError("a block is committed in the first step of the next one, where every row runs.")
        padding = self.padding if self.padding is None or rows is None else self.padding.select(rows)
        ids = (block if rows is None else block[rows])[:, window.lo:window.hi]
        noisy = _rows(NOISY, start + window.lo, start + window.hi, self.device, padding)
        q_rows = noisy
        if clean:
            ids = torch.cat([self.pending, ids], dim=1)
            q_rows = RowMeta.cat([_rows(CLEAN, self.length, self.length + clean, self.device, padding), noisy])
        keys = _rows(NOISY, start, start + B, self.device, padding) if settings.block_cache else noisy
        prefix = _rows(CLEAN, 0, self.length + clean, self.device, padding)
        k_rows = RowMeta.cat([prefix, keys]) if self.length + clean else keys
        self.cache.plan = _StepPlan(clean, rows, window, settings.block_cache, batch, B)
        try:
            hidden = _run_rows(self.model, ids, q_rows, k_rows, settings, self.cache, padding)
        finally:
            self.cache.plan = None
        if clean:
            self.length += clean
            self.pending = None
            self.last_hidden = hidden[:, clean - 1]
        last = self.last_hidden if self.last_hidden is None or rows is None else self.last_hidden[rows]
        return hidden[:, clean:], last

    def block_hidden(self, block: torch.Tensor, start: int):
        """Hidden states of the whole ``block`` (every row) over the clean prefix, and the prefix's last clean state."""
        return self.step(block, start, None, StepWindow.whole(block.shape[0], block.shape[1], block.device))

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows ``index`` (finished rows leave the batch)."""
        if self.length:
            self.cache.batch_select_indices(index)
            self.last_hidden = self.last_hidden[index]
        if self.pending is not None:
            self.pending = self.pending[index]
        if self.padding is not None:
            self.padding = self.padding.select(index)


class RecomputedContext:
    """No cache: every step runs the whole clean prefix plus the noisy block (the reference for the cache)."""

    def __init__(self, model, settings: DecodeSettings, device, padding: LeftPadding | None = None):
        if settings.block_cache:
            raise ValueError("block_cache=True keeps K/V across the steps of a block; it needs use_cache=True.")
        self.model, self.settings, self.device, self.padding = model, settings, device, padding
        self.prefix = None

    def append(self, ids: torch.Tensor) -> None:
        self.prefix = ids if self.prefix is None else torch.cat([self.prefix, ids], dim=1)

    def step(self, block: torch.Tensor, start: int, rows: torch.Tensor | None, window: StepWindow):
        if (window.lo, window.hi) != (0, block.shape[1]):
            raise RuntimeError("without a cache every step runs the whole block.")
        padding = self.padding if self.padding is None or rows is None else self.padding.select(rows)
        block = block if rows is None else block[rows]
        noisy = _rows(NOISY, start, start + block.shape[1], self.device, padding)
        if self.prefix is None:
            return _run_rows(self.model, block, noisy, noisy, self.settings, padding=padding), None
        prefix = self.prefix if rows is None else self.prefix[rows]
        q_rows = RowMeta.cat([_rows(CLEAN, 0, start, self.device, padding), noisy])
        hidden = _run_rows(self.model, torch.cat([prefix, block], dim=1), q_rows, q_rows, self.settings,
                           padding=padding)
        return hidden[:, start:], hidden[:, start - 1]

    def block_hidden(self, block: torch.Tensor, start: int):
        return self.step(block, start, None, StepWindow.whole(block.shape[0], block.shape[1], block.device))

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows ``index``."""
        if self.prefix is not None:
            self.prefix = self.prefix[index]
        if self.padding is not None:
            self.padding = self.padding.select(index)


# --- choosing tokens ---------------------------------------------------------------------------


def choose_tokens(logits: torch.Tensor, settings: DecodeSettings, generator: torch.Generator | None):
    """Tokens and their confidences (probability of the chosen token) for ``logits [n, vocab]``."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # softmax and the threshold comparison in half precision are too coarse
    logits = logits.clone()
    if settings.unmasking == "hf_bdlm":
        logits[:, settings.mask_token_id] = -math.inf  # [MASK] is never a prediction
    # (The engines' rules take the argmax / sample over the whole vocabulary, [MASK] included.)
    if not settings.do_sample:
        probs = logits.softmax(-1)
        confidence, tokens = probs.max(-1)
        return tokens, confidence
    # The same warpers as transformers' sampling, so temperature/top-k/top-p mean what users expect.
    if settings.temperature != 1.0:
        logits = TemperatureLogitsWarper(settings.temperature)(None, logits)
    scaled = logits
    if settings.top_k:
        logits = TopKLogitsWarper(settings.top_k)(None, logits)
    if settings.top_p < 1.0:
        logits = TopPLogitsWarper(settings.top_p)(None, logits)
    probs = logits.softmax(-1)
    tokens = torch.multinomial(probs, 1, generator=generator)
    if settings.unmasking == "lmdeploy_low_confidence_dynamic":
        # LMDeploy scores the sampled token under the temperature-scaled softmax, before top-k / top-p filtering.
        probs = scaled.softmax(-1)
    return tokens[:, 0], probs.gather(1, tokens)[:, 0]


def tokens_to_unmask(masked: torch.Tensor, confidence: torch.Tensor, step: int, settings: DecodeSettings):
    """Boolean ``[b, B]``: the masked positions to fix this step (the most confident first)."""
    remaining = masked.sum(1)
    conf = confidence.masked_fill(~masked, -math.inf)
    count = torch.ones_like(remaining)
    if settings.confidence_threshold is not None:
        # SGLang's LowConfidence compares strictly; LMDeploy and this project's rule include the threshold.
        above = conf > settings.confidence_threshold if settings.unmasking == "sglang_low_confidence" else \
            conf >= settings.confidence_threshold
        count = torch.maximum(count, (masked & above).sum(1))
    if settings.steps_per_block is not None:
        steps_left = settings.steps_per_block - step
        needed = remaining if steps_left <= 1 else -torch.div(-remaining, steps_left, rounding_mode="floor")  # ceil
        count = torch.maximum(count, needed)
    count = torch.maximum(count, torch.full_like(count, settings.min_tokens_per_step))
    count = torch.minimum(count, remaining)
    order = conf.argsort(dim=1, descending=True, stable=True)
    positions = torch.arange(order.shape[1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, positions)
    return masked & (rank < count[:, None])


def denoise_block(model, context, block, masked, start, settings, generator, done=None):
    """Denoise ``block`` (``[b, B]``) until every row is done with it; returns the finished block.

    A row is done when none of its ``masked`` positions is left, when (``settings.eos_early_exit``) an EOS is fixed
    with no masked position before it, when an engine rule's step changes nothing (SGLang), or from the start
    (``done``, e.g. rows that ended in an earlier block). Each step fixes positions of the first sub-block that still
    holds a masked one (the whole block without sub-blocks); with ``settings.compact_batch`` only the rows not done
    run in it. Every row's tokens depend on its own rows only, so a row decodes the same alone or in any batch."""
    block, masked = block.clone(), masked.clone()
    batch, B = block.shape
    device = block.device
    S = settings.sub_block_size or B
    shift = int(settings.token_shift)
    generated = masked.clone()  # the positions this block decodes (a prompt tail is never an end)
    done = torch.zeros(batch, dtype=torch.bool, device=device) if done is None else done.clone()
    eos = torch.tensor(settings.eos_token_ids, dtype=block.dtype, device=device)
    columns = torch.arange(B, device=device)
    last_sub = torch.full((batch,), -1, dtype=torch.long, device=device)
    step = 0
    while True:
        done |= ~masked.any(1)
        if settings.eos_early_exit and eos.numel():
            done |= _eos_settled(block, masked, generated, eos)
        if bool(done.all()):
            return block
        running = ~done
        rows = running.nonzero()[:, 0] if settings.compact_batch and not bool(running.all()) else None
        # Each row's sub-block: the first one holding a masked position.
        sub = torch.where(masked, columns, B).min(1).values.clamp(max=B - 1) // S
        refresh = (sub != last_sub) if settings.block_cache else torch.ones_like(running)
        own_lo = torch.where(refresh, 0, (sub * S - shift).clamp(min=0))
        own_hi = torch.where(refresh, B, sub * S + S)
        own_lo, own_hi = own_lo.masked_fill(done, 0), own_hi.masked_fill(done, 0)  # a done row takes nothing fresh
        lo, hi = int(own_lo[running].min()), int(own_hi[running].max())
        take = slice(None) if rows is None else rows
        window = StepWindow(lo, hi, own_lo[take], own_hi[take])
        hidden, clean_last = context.step(block, start, rows, window)

        # The positions a step may fix, and the row predicting each (its own, or with token shift the one before;
        # the block's first position then comes from the clean stream's last row).
        in_sub = (columns[None] // S) == sub[take][:, None]
        candidates = masked[take] & in_sub & running[take][:, None]
        row_index, column = candidates.nonzero(as_tuple=True)
        source = hidden[row_index, (column - shift - lo).clamp(min=0)]
        from_clean = (column == 0) & bool(shift)
        if bool(from_clean.any()):
            first = clean_last if clean_last is not None else torch.zeros_like(hidden[:, 0])
            source = torch.where(from_clean[:, None], first[row_index], source)
        tokens, conf = choose_tokens(model.lm_logits(source), settings, generator)
        if clean_last is not None:
            # The clean prediction of the block's first token does not change with the block's content: fix it at
            # once, so the rest of the block is denoised knowing it.
            conf = torch.where(from_clean, math.inf, conf)
        full_tokens = block[take].clone()
        full_tokens[row_index, column] = tokens
        full_conf = torch.zeros(candidates.shape, dtype=conf.dtype, device=device)
        full_conf[row_index, column] = conf
        unmask = tokens_to_unmask(candidates, full_conf, step, settings)
        if settings.unmasking == "sglang_low_confidence":
            # SGLang reads the masked positions off the ids: a position whose argmax is [MASK] stays masked. A step
            # that fixes nothing else leaves the ids, hence the next forward and step, unchanged: the row's block
            # ends with its masks (SGLang runs out its step budget, block size + 1, the same way).
            unmask &= full_tokens != settings.mask_token_id
            stalled = candidates.any(1) & ~unmask.any(1)
            done[take] = done[take] | stalled
        block[take] = torch.where(unmask, full_tokens, block[take])
        masked[take] = masked[take] & ~unmask
        last_sub[take] = torch.where(running[take], sub[take], last_sub[take])
        step += 1


def _eos_settled(block, masked, generated, eos) -> torch.Tensor:
    """Rows with a generated EOS fixed and no masked position before it: nothing after it can reach the output."""
    settled_eos = generated & ~masked & torch.isin(block, eos)
    first_eos = torch.where(settled_eos, torch.arange(block.shape[1], device=block.device), block.shape[1]).min(1)
    first_masked = torch.where(masked, torch.arange(block.shape[1], device=block.device), block.shape[1]).min(1)
    return (first_eos.values < block.shape[1]) & (first_masked.values > first_eos.values)


# --- the decoding loop -------------------------------------------------------------------------


def _check_inputs(model, input_ids, attention_mask) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a LongTensor of shape [batch, prompt_len], got {shape} "
                         "(use input_ids[None] for a single prompt).")
    if input_ids.shape[0] == 0:
        raise ValueError(f"input_ids is an empty batch (shape {tuple(input_ids.shape)}); pass at least one prompt.")
    if input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids has empty prompts (shape {tuple(input_ids.shape)}); block diffusion decoding needs at least "
            "one prompt token (e.g. the BOS token)."
        )
    model.config.check_token_ids(input_ids)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} must have the shape of input_ids "
                f"{tuple(input_ids.shape)}."
            )
        mask = attention_mask.bool()
        if (mask[:, :-1] & ~mask[:, 1:]).any():
            raise ValueError(
                "attention_mask must be left padding (zeros, then ones) for generation; right-padded prompts would "
                "put pad tokens between the prompt and the generated text: tokenize with padding_side='left'."
            )
        if not mask[:, -1].all():
            raise ValueError("attention_mask has a row with no prompt token; every prompt needs at least one token.")


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    generation_config: GenerationConfig | None = None,
    use_cache: bool = True,
    **kwargs,
) -> torch.LongTensor:
    r"""
    Block-wise diffusion decoding with a [`BlockDiffusionForMaskedLM`].

    Args:
        model ([`BlockDiffusionForMaskedLM`]):
            The model.
        input_ids (`torch.LongTensor` of shape `[batch, prompt_len]`):
            Prompts. Rows of a batch have the same length unless `attention_mask` marks left padding.
        generation_config ([`~transformers.GenerationConfig`], *optional*):
            Defaults to `model.generation_config` (or one made from the model config); a plain `GenerationConfig`
            is converted to a [`BlockDiffusionGenerationConfig`].
        use_cache (`bool`, defaults to `True`):
            Keep the clean prefix as a KV cache. `False` recomputes the prefix at every step (same tokens; slower).
        kwargs:
            `attention_mask` (left padding), `generator` (a `torch.Generator` for sampling), `streamer` (as in
            transformers: `put` gets the prompt, then each decoded block's new tokens, `end` follows the last; one
            prompt only, e.g. a `TextStreamer`), and any field of [`BlockDiffusionGenerationConfig`] (e.g.
            `max_new_tokens=64, confidence_threshold=0.9`).

    Returns:
        `torch.LongTensor` of shape `[batch, prompt_len + n]`, `n <= max_new_tokens`: the prompts followed by the
        generated tokens, each row cut after its first generated EOS and right-padded with `pad_token_id`.
    """
    attention_mask = kwargs.pop("attention_mask", None)
    generator = kwargs.pop("generator", None)
    streamer = kwargs.pop("streamer", None)
    if generation_config is None:
        generation_config = getattr(model, "generation_config", None)
        if generation_config is None:
            generation_config = BlockDiffusionGenerationConfig.from_model_config(model.config)
    config = as_block_diffusion_config(generation_config)
    unused = config.update(**kwargs)
    if unused:
        raise TypeError(
            f"generate() got unexpected arguments {sorted(unused)}: pass attention_mask, generator, streamer or "
            f"fields of BlockDiffusionGenerationConfig ({', '.join(BLOCK_DIFFUSION_FIELDS)}, max_new_tokens, "
            "do_sample, ...)."
        )
    config.validate()
    _check_inputs(model, input_ids, attention_mask)
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError(f"a streamer streams one prompt (as transformers' streamers do), got a batch of "
                         f"{input_ids.shape[0]}; generate the prompts one at a time to stream them.")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    return _decode_left_padded(model, input_ids, mask, config, use_cache, generator, streamer)


def _decode_left_padded(model, input_ids, mask, config, use_cache, generator, streamer=None) -> torch.Tensor:
    """Decode the rows together (each row's blocks start at its first real token), re-assemble HF-style."""
    width = input_ids.shape[1]
    # max_length counts the padded width, as in transformers, so every row gets the same budget.
    settings = resolve_settings(model, config, width)
    prompts = [input_ids[i][mask[i]] for i in range(input_ids.shape[0])]
    on_block = None
    if streamer is not None:
        streamer.put(input_ids.cpu())  # the prompt first, as transformers' generate does

        def on_block(new: dict[int, torch.Tensor]) -> None:
            for tokens in new.values():
                streamer.put(tokens.cpu())

    rows = decode_ragged(model, prompts, settings, use_cache, generator, on_block=on_block)
    if streamer is not None:
        streamer.end()
    longest = max(r.shape[0] for r in rows)
    # Rows only differ in length when EOS ended some, and then pad_token_id is set (it defaults to EOS).
    out = input_ids.new_full((input_ids.shape[0], width + longest), settings.pad_token_id or 0)
    out[:, :width] = input_ids
    for i, r in enumerate(rows):
        out[i, width : width + r.shape[0]] = r
    return out


BlockCallback = Callable[[dict[int, torch.Tensor]], "set[int] | None"]


def decode_ragged(
    model,
    prompts: Sequence[torch.Tensor],
    settings: DecodeSettings,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    max_new_tokens: Sequence[int] | None = None,
    on_block: BlockCallback | None = None,
) -> list[torch.Tensor]:
    """Block-wise decoding of prompts of any lengths in one batch (see :class:`LeftPadding`).

    Args:
        prompts: 1-D token tensors, one per row (at least one token each).
        settings: the decoding settings shared by the batch (`resolve_settings`).
        max_new_tokens: a budget per row (default: `settings.max_new_tokens` for every row).
        on_block: called after every decoded block with `{row: new tokens}` of the rows still running (tokens after
            an EOS or past the row's budget already cut); returns the rows to stop now (e.g. a stop string was
            generated, or the client went away), or `None`.

    Returns:
        One 1-D tensor of generated tokens per row: up to and including its first EOS, at most its budget.
    """
    B = settings.block_size
    device = prompts[0].device
    budgets = list(max_new_tokens) if max_new_tokens is not None else [settings.max_new_tokens] * len(prompts)
    lengths = torch.tensor([int(p.numel()) for p in prompts])
    full = torch.div(lengths, B, rounding_mode="floor")
    start = int(full.max()) * B  # column of the first decoded block; every row's prompt blocks end there
    pad = (start - full * B).to(device)
    padding = LeftPadding(pad) if bool(pad.any()) else None
    context = (CachedContext if use_cache else RecomputedContext)(model, settings, device, padding)
    if start:
        prefix = torch.zeros((len(prompts), start), dtype=prompts[0].dtype, device=device)
        for i, p in enumerate(prompts):
            prefix[i, int(pad[i]) :] = p[: int(full[i]) * B]
        context.append(prefix)
    block = torch.full((len(prompts), B), settings.mask_token_id, dtype=prompts[0].dtype, device=device)
    masked = torch.ones((len(prompts), B), dtype=torch.bool, device=device)
    tails = []
    for i, p in enumerate(prompts):
        tail = p[int(full[i]) * B :]
        block[i, : tail.numel()] = tail
        masked[i, : tail.numel()] = False
        tails.append(tail.numel())
    eos = torch.tensor(settings.eos_token_ids, dtype=block.dtype, device=device)
    generated: list[list[torch.Tensor]] = [[] for _ in prompts]
    counts = [0] * len(prompts)
    active = list(range(len(prompts)))  # original row index of each batch row
    while True:
        block = denoise_block(model, context, block, masked, start, settings, generator)
        new, finished = {}, set()
        for j, row in enumerate(active):
            tokens = block[j, tails[j] :][: budgets[row] - counts[row]]
            hits = torch.isin(tokens, eos).nonzero()
            if len(hits):
                tokens = tokens[: int(hits[0]) + 1]
                finished.add(row)
            generated[row].append(tokens)
            counts[row] += tokens.numel()
            new[row] = tokens
            if counts[row] >= budgets[row]:
                finished.add(row)
        if on_block is not None:
            finished |= set(on_block(new) or ())
        keep = [j for j, row in enumerate(active) if row not in finished]
        if not keep:
            break
        if len(keep) < len(active):
            index = torch.tensor(keep, device=device)
            context.select(index)
            block = block[index]
            active = [active[j] for j in keep]
        context.append(block)
        start += B
        tails = [0] * len(active)
        block = torch.full_like(block, settings.mask_token_id)
        masked = torch.ones_like(block, dtype=torch.bool)
    return [torch.cat(parts) if parts else prompts[0].new_empty(0) for parts in generated]
