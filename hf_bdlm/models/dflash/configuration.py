"""`DFlashConfig`: the configuration of a DFlash / DFlash2 speculative drafter. Its ``config.json`` is the file the
serving engines read: vLLM (``--speculative-config '{"method": "dflash", "model": DIR}'``) and SGLang
(``--speculative-algorithm DFLASH --speculative-draft-model-path DIR``).

The file is a Qwen3 layer config (``model_type: "qwen3"``: the drafter's layers are Qwen3 decoder layers) plus the
DFlash fields:

- ``architectures``: ``["DFlashDraftModel"]`` or ``["DFlash2DraftModel"]`` (written by ``save_pretrained``);
- ``dflash_config``: ``block_size``, ``mask_token_id``, ``target_layer_ids`` and, for DFlash2, ``conv_kernel_size``,
  ``conv_group_size``, ``selector_rank``, ``selector_top_k``, ``attention_mode``;
- ``target_hidden_size`` (the target's width; ``fc`` reads ``len(target_layer_ids) * target_hidden_size`` features),
  ``num_target_layers`` (the target's depth), and ``is_causal`` when set.

Layer ids. In Python (``config.target_layer_ids``) they are *canonical*: ``i`` is ``hidden_states[i]`` of
transformers' ``output_hidden_states`` (0: the embedding output, ``i``: the output of decoder layer ``i - 1``). The
file keeps the serving engines' convention, the decoder layer whose output is read: ``dflash_config.target_layer_ids
= canonical - 1``. So a drafter reads decoder-layer outputs only (canonical ids ``1 .. num_target_layers``).

    from transformers import AutoConfig
    from hf_bdlm.models.dflash.configuration import DFlashConfig
    target = AutoConfig.from_pretrained("Qwen/Qwen3-8B")
    config = DFlashConfig.for_target(target, num_hidden_layers=5, block_size=8)   # DFlash2 by default
    config.target_layer_ids      # (2, 10, 18, 26, 34): canonical; config.json holds [1, 9, 17, 25, 33]
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import Qwen3Config

logger = logging.getLogger(__name__)

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
# The fields that make a drafter a DFlash2 one (a serving engine enables the convolutions and the selector when it
# finds them, so a DFlash config must not carry them).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# The settings of the published DFlash2 drafters (z-lab/Qwen3.8-27B-DFlash2), the defaults of `for_target`.
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
ATTENTION_MODES = ("gqa", "mha")
# Keys the serving contract needs in config.json even when they equal a Qwen3 default (transformers leaves default
# values out of the file, and some readers have defaults of their own).
SERVING_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
    "attention_bias", "attention_dropout", "layer_types", "sliding_window", "use_sliding_window",
    "tie_word_embeddings", "dflash_config", "target_hidden_size", "num_target_layers", "architectures",
)
# The spellings of the drafter's block causality that other writers use, folded into ``is_causal``.
_CAUSALITY_ALIASES = ("sliding_window_non_causal", "causal")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """Canonical ids of the target layers a drafter reads when none are given: the rule the serving engines apply to
    a DFlash config without ``target_layer_ids`` (SGLang's ``build_target_layer_ids``, from the DFlash authors).

    One layer: the middle decoder layer's output (decoder layer ``L // 2``). ``n > 1`` layers: the outputs of ``n``
    decoder layers evenly spread from the second to the third-from-last (decoder layer ``round(1 + i * (L - 4) /
    (n - 1))``), the published drafters' choice (z-lab's Qwen3-8B drafter reads decoder layers 1, 9, 17, 25, 33).

    Args:
        num_target_layers (`int`): the target's decoder layers ``L``.
        num_features (`int`): how many layers to read.

    Returns:
        `tuple[int, ...]`: canonical ids (decoder layer ``j``'s output is id ``j + 1``).
    """
    if not _is_int(num_target_layers) or num_target_layers <= 0:
        raise ValueError(f"num_target_layers must be a positive integer, got {num_target_layers!r}.")
    if not _is_int(num_features) or num_features <= 0:
        raise ValueError(f"the number of target layers to read must be a positive integer, got {num_features!r}.")
    if num_features == 1:
        return (num_target_layers // 2 + 1,)
    span = num_target_layers - 4
    ids = tuple(int(round(1 + i * span / (num_features - 1))) + 1 for i in range(num_features))
    if span < 0 or len(set(ids)) != num_features:
        raise ValueError(
            f"cannot spread {num_features} distinct feature layers over a target of {num_target_layers} layers (the "
            f"rule needs at least {num_features + 3}); pass target_layer_ids explicitly (canonical ids, 1 = decoder "
            "layer 0's output)."
        )
    return ids


class DFlashConfig(Qwen3Config):
    r"""
    Configuration of a DFlash (``DFlashDraftModel``) or DFlash2 (``DFlash2DraftModel``) drafter: the Qwen3 layer
    fields (`transformers.Qwen3Config`) of its layer stack, and the fields below. Build one for a target with
    [`DFlashConfig.for_target`].

    Parameters:
        dflash_config (`dict`):
            The serving mapping: `block_size` (tokens per draft block, anchor included, >= 2), `mask_token_id` (the
            id filling the block's other slots; embedded by the target's embedding), `target_layer_ids` (serving
            convention: the decoder layers whose outputs are read, `canonical - 1`) and, for DFlash2,
            `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`, `attention_mode`
            (`"gqa"`/`"mha"`). Optional: `output_multiplier`, `final_logit_softcapping` (applied to the logits).
        target_hidden_size (`int`, *optional*):
            Width of the target's hidden states. Defaults to `hidden_size`.
        num_target_layers (`int`, *optional*):
            The target's decoder layers (checks the layer ids; serving engines read it).
        is_causal (`bool`, *optional*):
            Unset (the default): a draft block attends to itself bidirectionally on full-attention layers and
            causally on sliding-window layers. `False`: bidirectionally on every layer. `True` is accepted only when
            every layer slides (serving engines would otherwise make the full-attention layers causal as well).

    Shorthand constructor arguments, folded into `dflash_config`: `block_size`, `mask_token_id`, `target_layer_ids`
    (canonical ids), `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`, `attention_mode`,
    `output_multiplier`, `final_logit_softcapping`; `sliding_window_non_causal` and `causal` are folded into
    `is_causal`. The layer types: `layer_types` (all `"full_attention"` by default); `sliding_window` is the window
    of the `"sliding_attention"` layers (`use_sliding_window` is set when any layer slides).
    """

    dflash_config: dict | None = None
    target_hidden_size: int | None = None
    num_target_layers: int | None = None
    is_causal: bool | None = None

    def __post_init__(self, **kwargs):
        method = dict(self.dflash_config or {})
        for name in ("block_size", "mask_token_id", *DFLASH2_FIELDS, "attention_mode", "output_multiplier",
                     "final_logit_softcapping"):
            if name in kwargs:
                _fold(method, name, kwargs.pop(name), where="dflash_config")
        if "target_layer_ids" in kwargs:  # canonical ids (as a top-level key of other writers, too)
            canonical = kwargs.pop("target_layer_ids")
            if canonical is not None:
                if isinstance(canonical, (str, bytes)) or not hasattr(canonical, "__iter__"):
                    raise ValueError(f"target_layer_ids must be a sequence of canonical layer ids, got {canonical!r}.")
                native = [int(i) - 1 for i in canonical]
                if method.get("target_layer_ids") is not None and list(method["target_layer_ids"]) != native:
                    raise ValueError(f"target_layer_ids={list(canonical)} (canonical ids) disagrees with "
                                     f"dflash_config.target_layer_ids={list(method['target_layer_ids'])} (decoder "
                                     "layers, canonical - 1): give one of them.")
                method["target_layer_ids"] = native
        self._fold_causality(kwargs, method)
        self.dflash_config = method
        if self.layer_types is not None and "sliding_attention" in self.layer_types and self.sliding_window:
            self.use_sliding_window = True  # Qwen3Config drops sliding_window otherwise
        super().__post_init__(**kwargs)
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.is_dflash2 and "attention_mode" not in method:
            method["attention_mode"] = "mha" if self.num_key_value_heads == self.num_attention_heads else "gqa"
        self.validate_dflash()

    def _fold_causality(self, kwargs: dict, method: dict) -> None:
        spellings = []
        if self.is_causal is not None:
            spellings.append(("is_causal", bool(self.is_causal)))
        if kwargs.get("sliding_window_non_causal") is not None:
            spellings.append(("sliding_window_non_causal", not bool(kwargs["sliding_window_non_causal"])))
        if method.get("causal") is not None:
            spellings.append(("dflash_config.causal", bool(method["causal"])))
        if kwargs.get("causal") is not None:
            spellings.append(("causal", bool(kwargs["causal"])))
        for name in _CAUSALITY_ALIASES:
            kwargs.pop(name, None)
        method.pop("causal", None)
        if len({value for _, value in spellings}) > 1:
            raise ValueError(f"the drafter's causality is given twice, differently: {spellings}. Give only is_causal.")
        if spellings:
            self.is_causal = spellings[0][1]

    # --- the DFlash fields -----------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """Tokens per draft block, the anchor included."""
        return self.dflash_config["block_size"]

    @property
    def mask_token_id(self) -> int:
        """The id filling the draft block's slots after the anchor."""
        return self.dflash_config["mask_token_id"]

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """Canonical ids of the target hidden states the drafter reads (``hidden_states[i]``, 0 = embeddings)."""
        return tuple(int(i) + 1 for i in self.dflash_config["target_layer_ids"])

    @property
    def is_dflash2(self) -> bool:
        """Whether this is a DFlash2 drafter (block convolutions and a candidate selector)."""
        return all(self.dflash_config.get(name) is not None for name in DFLASH2_FIELDS)

    @property
    def architecture(self) -> str:
        """``"DFlash2DraftModel"`` or ``"DFlashDraftModel"``: the model class this config builds."""
        return ARCHITECTURES[1] if self.is_dflash2 else ARCHITECTURES[0]

    @property
    def sliding_window_non_causal(self) -> bool:
        """Whether draft blocks attend to themselves bidirectionally on sliding-window layers too."""
        return self.is_causal is False

    @property
    def output_multiplier(self) -> float:
        return float(self.dflash_config.get("output_multiplier", 1.0))

    @property
    def final_logit_softcapping(self) -> float | None:
        value = self.dflash_config.get("final_logit_softcapping")
        return None if value is None else float(value)

    @property
    def feature_width(self) -> int:
        """Width of the target features ``fc`` reads: ``len(target_layer_ids) * target_hidden_size``."""
        return len(self.dflash_config["target_layer_ids"]) * self.target_hidden_size

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (``None`` on a full-attention layer)."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    def layer_block_causal(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` attends causally inside a draft block (sliding layers, unless non-causal)."""
        return self.layer_window(layer_idx) is not None and not self.sliding_window_non_causal

    # --- validation ------------------------------------------------------------------------------------------------
    def validate_dflash(self) -> None:
        """Raise a `ValueError` naming the field, the value and the fix, for a config a drafter cannot run or a
        serving engine would read differently."""
        method = self.dflash_config
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "target_hidden_size", "vocab_size"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"DFlashConfig.{name} must be a positive integer, got {value!r}.")
        if self.num_target_layers is not None and (not _is_int(self.num_target_layers) or self.num_target_layers <= 0):
            raise ValueError(f"num_target_layers must be a positive integer, got {self.num_target_layers!r}.")
        block_size = method.get("block_size")
        if not _is_int(block_size) or block_size < 2:
            raise ValueError(f"dflash_config.block_size must be an integer >= 2 (the anchor and at least one drafted "
                             f"token), got {block_size!r}.")
        mask_token_id = method.get("mask_token_id")
        if not _is_int(mask_token_id) or not 0 <= mask_token_id < self.vocab_size:
            raise ValueError(f"dflash_config.mask_token_id must be a token id in [0, {self.vocab_size}) (the "
                             f"target's vocabulary), got {mask_token_id!r}.")
        self._validate_layer_ids(method.get("target_layer_ids"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}).")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embedding), got {self.head_dim}.")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                             f"{self.num_hidden_layers}.")
        unknown = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"layer_types may hold 'full_attention' and 'sliding_attention' only, got {unknown}.")
        sliding = "sliding_attention" in self.layer_types
        if sliding and (not _is_int(self.sliding_window) or self.sliding_window <= 0):
            raise ValueError(f"sliding_attention layers need a positive integer sliding_window, got "
                             f"{self.sliding_window!r}.")
        if self.is_causal is True and "full_attention" in self.layer_types:
            raise ValueError("is_causal=True is ambiguous with full-attention layers (the drafter's convention keeps "
                             "them bidirectional, serving engines would make them causal): drop is_causal (sliding "
                             "layers are block-causal by default) or make every layer a sliding_attention layer.")
        if self.hidden_act != "silu":
            raise ValueError(f"the drafter's MLP is SwiGLU: hidden_act must be 'silu', got {self.hidden_act!r}.")
        if self.attention_dropout:
            raise ValueError(f"attention_dropout must be 0, got {self.attention_dropout!r}.")
        if not self.initializer_range or self.initializer_range <= 0:
            raise ValueError(f"initializer_range must be positive, got {self.initializer_range!r}.")
        rope_type = (self.rope_parameters or {}).get("rope_type", (self.rope_parameters or {}).get("type"))
        if rope_type not in (None, "default"):
            raise ValueError(f"the drafter uses plain RoPE: rope_parameters.rope_type must be 'default', got "
                             f"{rope_type!r}.")
        if self.output_multiplier <= 0:
            raise ValueError(f"dflash_config.output_multiplier must be positive, got {self.output_multiplier!r}.")
        softcap = self.final_logit_softcapping
        if softcap is not None and softcap <= 0:
            raise ValueError(f"dflash_config.final_logit_softcapping must be positive or absent, got {softcap!r}.")
        draft_vocab = getattr(self, "draft_vocab_size", None)
        if draft_vocab is not None and draft_vocab != self.vocab_size:
            raise ValueError(f"reduced draft vocabularies are not supported: draft_vocab_size ({draft_vocab}) must "
                             f"equal vocab_size ({self.vocab_size}).")
        self._validate_dflash2_fields()

    def _validate_layer_ids(self, native) -> None:
        if (not isinstance(native, (list, tuple)) or not native
                or any(not _is_int(i) for i in native)):
            raise ValueError(f"dflash_config.target_layer_ids must be a non-empty list of integers, got {native!r} "
                             "(give target_layer_ids= canonical ids, or build the config with "
                             "DFlashConfig.for_target).")
        canonical = [i + 1 for i in native]
        if len(set(canonical)) != len(canonical):
            raise ValueError(f"target_layer_ids must be distinct, got canonical ids {canonical}.")
        if min(canonical) < 1:
            raise ValueError(f"target_layer_ids must be decoder-layer outputs (canonical ids >= 1; 0 is the "
                             f"embedding output, which serving engines do not capture), got canonical ids {canonical}.")
        if self.num_target_layers is not None and max(canonical) > self.num_target_layers:
            raise ValueError(f"target_layer_ids {canonical} (canonical) exceed the target's {self.num_target_layers} "
                             f"decoder layers (ids 1..{self.num_target_layers}).")

    def _validate_dflash2_fields(self) -> None:
        method = self.dflash_config
        present = [name for name in DFLASH2_FIELDS if method.get(name) is not None]
        if present and len(present) != len(DFLASH2_FIELDS):
            missing = [name for name in DFLASH2_FIELDS if name not in present]
            raise ValueError(f"a DFlash2 config needs all of {list(DFLASH2_FIELDS)}; it has {present} but not "
                             f"{missing} (a DFlash config has none of them).")
        architectures = self.architectures or []
        if architectures and (len(architectures) != 1 or architectures[0] not in ARCHITECTURES):
            raise ValueError(f"architectures must be ['DFlashDraftModel'] or ['DFlash2DraftModel'], got "
                             f"{architectures!r}.")
        if architectures and architectures[0] != self.architecture:
            raise ValueError(f"architectures says {architectures[0]} but dflash_config "
                             f"{'has' if present else 'lacks'} the DFlash2 fields {list(DFLASH2_FIELDS)}.")
        if not present:
            return
        for name in DFLASH2_FIELDS:
            if not _is_int(method[name]) or method[name] <= 0:
                raise ValueError(f"dflash_config.{name} must be a positive integer, got {method[name]!r}.")
        if method["conv_kernel_size"] > method["block_size"]:
            raise ValueError(f"dflash_config.conv_kernel_size ({method['conv_kernel_size']}) must not exceed "
                             f"block_size ({method['block_size']}): the convolution stays inside a block.")
        if self.hidden_size % method["conv_group_size"]:
            raise ValueError(f"dflash_config.conv_group_size ({method['conv_group_size']}) must divide hidden_size "
                             f"({self.hidden_size}).")
        if method["selector_top_k"] > self.vocab_size:
            raise ValueError(f"dflash_config.selector_top_k ({method['selector_top_k']}) must not exceed vocab_size "
                             f"({self.vocab_size}).")
        mode = method.get("attention_mode", "gqa")
        if str(mode).lower() not in ATTENTION_MODES:
            raise ValueError(f"dflash_config.attention_mode must be one of {ATTENTION_MODES}, got {mode!r}.")

    # --- serialisation ---------------------------------------------------------------------------------------------
    def to_diff_dict(self) -> dict[str, Any]:
        # transformers drops values equal to Qwen3's defaults; the serving contract needs every layer field written.
        out = super().to_diff_dict()
        full = self.to_dict()
        for key in SERVING_KEYS:
            if key in full and full[key] is not None:
                out[key] = full[key]
        for key in ("is_causal", "num_target_layers"):
            if out.get(key) is None:
                out.pop(key, None)
        out.pop("auto_map", None)  # a drafter folder carries no remote code
        out["architectures"] = [self.architecture]
        return out

    # --- construction ----------------------------------------------------------------------------------------------
    @classmethod
    def for_target(
        cls,
        target_config,
        *,
        num_hidden_layers: int = 1,
        target_layer_ids=None,
        block_size: int = 8,
        mask_token_id: int | None = None,
        dflash2: bool = True,
        **overrides,
    ) -> "DFlashConfig":
        """A drafter config for a target causal LM (Llama, Qwen2/3, Gemma, ...).

        Width, heads, head dim, MLP width, vocabulary, RMSNorm epsilon, RoPE base and context length default to the
        target's (its text config for a multimodal target); the layer stack is `num_hidden_layers` full-attention
        Qwen3 layers.

        Args:
            target_config (`PretrainedConfig`): the target's config.
            num_hidden_layers (`int`, defaults to 1): drafter layers.
            target_layer_ids (`Sequence[int]`, *optional*): canonical ids of the target hidden states to read.
                Defaults to one per drafter layer, spread by [`default_target_layer_ids`] (the serving engines'
                rule).
            block_size (`int`, defaults to 8): tokens per draft block, the anchor included.
            mask_token_id (`int`, *optional*): the id filling draft slots. Defaults to the target's `pad_token_id`,
                else its `eos_token_id` (first one when a list). Any id works as long as training and serving use
                the same one (config.json records it); the slot's RoPE position already tells the drafter it is a
                slot, so reusing pad/eos costs nothing but an anchor that is that very token. Raises when the target
                has neither: pass a reserved or padding id.
            dflash2 (`bool`, defaults to `True`): a DFlash2 drafter, with the published drafters' `conv_kernel_size=2,
                conv_group_size=16, selector_rank=256, selector_top_k=16` unless overridden.
            overrides: any other `DFlashConfig` field (`hidden_size`, `layer_types`, `sliding_window`, `is_causal`,
                `conv_group_size`, ...).
        """
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        num_target_layers = int(text.num_hidden_layers)
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_hidden_layers)
        if mask_token_id is None:
            mask_token_id = _default_mask_token_id(text)
        heads = int(text.num_attention_heads)
        hidden = int(overrides.get("hidden_size", text.hidden_size))
        values: dict[str, Any] = {
            "vocab_size": int(text.vocab_size),
            "hidden_size": hidden,
            "intermediate_size": int(getattr(text, "intermediate_size", None) or 4 * hidden),
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(text, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads),
            "rms_norm_eps": float(getattr(text, "rms_norm_eps", None) or 1e-6),
            "max_position_embeddings": int(getattr(text, "max_position_embeddings", None) or 32768),
            "rope_parameters": {"rope_type": "default", "rope_theta": _target_rope_theta(text)},
            "layer_types": ["full_attention"] * num_hidden_layers,
            "target_hidden_size": int(text.hidden_size),
            "num_target_layers": num_target_layers,
            "pad_token_id": getattr(text, "pad_token_id", None),
            "eos_token_id": getattr(text, "eos_token_id", None),
            "bos_token_id": getattr(text, "bos_token_id", None),
        }
        if dflash2:
            values.update(DFLASH2_DEFAULTS)
            values["architectures"] = ["DFlash2DraftModel"]
        else:
            values["architectures"] = ["DFlashDraftModel"]
        values.update(overrides)
        return cls(num_hidden_layers=num_hidden_layers, target_layer_ids=list(target_layer_ids),
                   block_size=block_size, mask_token_id=mask_token_id, **values)


def _fold(method: dict, name: str, value, *, where: str) -> None:
    if value is None:
        return
    if method.get(name) is not None and method[name] != value:
        raise ValueError(f"{name} is given twice, differently: {value!r} and {where}.{name}={method[name]!r}.")
    method[name] = value


def _default_mask_token_id(text_config) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(text_config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if _is_int(value) and 0 <= value < int(text_config.vocab_size):
            logger.info("DFlash mask_token_id defaults to the target's %s (%d).", name, value)
            return value
    raise ValueError("the target config has no pad_token_id or eos_token_id to use as the drafter's mask_token_id: "
                     "pass mask_token_id= (a reserved or padding id of the target's vocabulary).")


def _target_rope_theta(text_config) -> float:
    rope = getattr(text_config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and "rope_theta" not in rope:
        # Per-layer-type RoPE (Gemma 3 and later): the full-attention layers' base.
        rope = rope.get("full_attention") or next((v for v in rope.values() if isinstance(v, dict)), {})
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return float(theta if theta is not None else getattr(text_config, "rope_theta", None) or 10_000.0)


__all__ = ["ARCHITECTURES", "DFLASH2_DEFAULTS", "DFLASH2_FIELDS", "DFlashConfig", "default_target_layer_ids"]
