"""What the planner knows of a model: its layers' attention shapes, parameter counts and FLOPs per row.

:func:`model_spec` reads a transformers config (a ``config.json`` dict, a folder holding one, a
``PreTrainedConfig``, or a BDLM config with a ``backbone_config``; multimodal configs are read
from their ``text_config``): Llama / Qwen / Mistral / Gemma 3-style dense models and MoE models
(``num_experts`` with ``top_k_experts`` or ``num_experts_per_tok`` and ``moe_intermediate_size``;
Gemma 4's ``enable_moe_block`` keeps the dense MLP beside the experts). Per-layer
attention shapes follow ``layer_types`` (sliding layers get ``sliding_window``; Gemma 4's global
layers ``global_head_dim`` / ``num_global_key_value_heads``).

Presets stand for the paper's settings (:func:`presets`): ``gemma3-27b`` here (AR -> BDLM conversion: Gemma 3
27B's published sizes, the ``config.json`` of ``google/gemma-3-27b-pt``: hidden 5376, 62 layers, 32 heads, 16 K/V
heads, head dim 128, MLP 21504, vocabulary 262208, window 1024 on five of every six layers; block size 32, Fast-dLLM
v2's, token shift and a block-causal clean stream), and those each model family declares
(a family's planning role, ``PlanningSpec.presets``).

The training step modelled is the vectorized BDLM step (docs/design.md §1): ``2L`` rows, noisy rows
on every block (SFT whose completion spans the sequence); the loss runs the LM head on the noisy
rows (a family whose loss also scores the clean rows says so: ``head_on_clean``). A second decoder pass
(self-conditioning) is not modelled.

    python -c "from hf_bdlm.planner.model import model_spec; s = model_spec('gemma3-27b'); \\
print(s.name, s.total_params() / 1e9, s.active_params() / 1e9)"
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..protocols.registry import REGISTRY, family_for_model_type, family_named


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention: query heads, K/V heads, head dim, sliding window (``None``: full attention)."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    value_is_key: bool = False  # no v_proj: V = K (Gemma 4-style global layers); K and V still travel


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a backbone, enough to count parameters, FLOPs, activation and K/V bytes.

    Parameters:
        name (`str`): for tables.
        hidden (`int`), vocab (`int`): hidden size and vocabulary.
        layers (`tuple[AttentionShape, ...]`): every decoder layer's attention.
        intermediate (`int`): dense (gated) MLP width, 0 when the layers have only experts.
        num_experts (`int`), top_k (`int`), moe_intermediate (`int`): experts per layer (0: dense), experts a token
            runs, expert MLP width.
        tie_embeddings (`bool`): the LM head shares the embedding matrix.
        block_size (`int`): diffusion block ``B``.
        clean_attention (`str`): ``"block_causal"`` or ``"causal"`` (the clean stream's rule).
        window_convention (`str`): ``"per_query"`` or ``"block_start"`` (docs/design.md §1).
        head_on_clean (`bool`): the loss also runs the LM head on the clean rows (an AR loss).
        extra_params (`int`): parameters outside the decoder layers and embeddings (a family's own blocks,
            e.g. a self-conditioning MLP: ``PlanningSpec.cost_traits``); stored and sharded, their FLOPs neglected.
    """

    name: str
    hidden: int
    vocab: int
    layers: tuple[AttentionShape, ...]
    intermediate: int
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    tie_embeddings: bool = False
    block_size: int = 32
    clean_attention: str = "block_causal"
    window_convention: str = "per_query"
    head_on_clean: bool = False
    extra_params: int = 0
    notes: tuple[str, ...] = field(default=(), compare=False)

    # --- parameters ------------------------------------------------------------------------------
    def attention_params(self, i: int) -> int:
        a = self.layers[i]
        kv_projections = 1 if a.value_is_key else 2
        return self.hidden * a.heads * a.head_dim * 2 + self.hidden * a.kv_heads * a.head_dim * kv_projections

    def mlp_params(self) -> int:
        """Dense MLP (gate, up, down) of one layer."""
        return 3 * self.hidden * self.intermediate

    def expert_params(self) -> int:
        """One expert's MLP (gate, up, down)."""
        return 3 * self.hidden * self.moe_intermediate

    def router_params(self) -> int:
        return self.hidden * self.num_experts

    def layer_params(self, i: int) -> int:
        norms = 4 * self.hidden  # pre/post norms, a rounding error beside the matrices
        return (self.attention_params(i) + self.mlp_params() + self.num_experts * self.expert_params()
                + self.router_params() + norms)

    def layer_active_params(self, i: int) -> int:
        """Matrix parameters one token runs through in layer ``i`` (the ``top_k`` experts only)."""
        return self.attention_params(i) + self.mlp_params() + self.top_k * self.expert_params() + self.router_params()

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    def total_params(self) -> int:
        return self.embedding_params() + sum(self.layer_params(i) for i in range(len(self.layers))) + self.extra_params

    def active_params(self) -> int:
        return self.embedding_params() + sum(self.layer_active_params(i) for i in range(len(self.layers)))

    # --- FLOPs and bytes per row -----------------------------------------------------------------
    def linear_flops_per_row(self) -> int:
        """Forward FLOPs of one row through every layer's matrices (2 per multiply-add), attention scores excluded."""
        return 2 * sum(self.layer_active_params(i) for i in range(len(self.layers)))

    def head_flops_per_row(self) -> int:
        """Forward FLOPs of the LM head on one row that carries a loss."""
        return 2 * self.hidden * self.vocab

    def activation_elements_per_row(self, i: int) -> int:
        """Elements one row keeps for backward in layer ``i`` without checkpointing.

        Residual input and the two norm outputs (3h) plus the residual after attention (h); q, attention output,
        k, v; the MLP's gate, up, activation and product (4 I), the same for each of the ``top_k`` experts, the
        router logits. An estimate of what autograd saves for a gated-MLP decoder layer.
        """
        a = self.layers[i]
        return (4 * self.hidden + 2 * a.heads * a.head_dim + 2 * a.kv_heads * a.head_dim
                + 4 * self.intermediate + 4 * self.top_k * self.moe_intermediate + self.num_experts)


def _get(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _load_config(source) -> tuple[dict, str]:
    if isinstance(source, dict):
        return source, source.get("_name_or_path") or source.get("model_type") or "model"
    if hasattr(source, "to_dict"):
        return source.to_dict(), getattr(source, "name_or_path", "") or type(source).__name__
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"--model {source!r} is neither a known preset ({', '.join(presets())}) nor a config.json file or a "
            "folder holding one.")
    with open(path) as f:
        return json.load(f), os.path.basename(os.path.dirname(os.path.abspath(path))) or path


def spec_from_config(cfg: dict, name: str = "model", block_size: int | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a transformers config dict (see the module docstring for what is read)."""
    outer = cfg
    # What the model's family adds to the decoder config (its planning role: PlanningSpec.cost_traits); a family
    # without one is refused before its config is read.
    planning = family_for_model_type(outer.get("model_type")).role("planning", name)
    if isinstance(cfg.get("backbone_config"), dict):  # a BlockDiffusionConfig
        cfg = cfg["backbone_config"]
    if isinstance(cfg.get("text_config"), dict):  # Gemma 3/4 and the multimodal or encoder-decoder configs
        cfg = cfg["text_config"]
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"the model config {name!r} lacks {missing}: the planner needs a decoder's config.json "
                         "(hidden_size, num_hidden_layers, num_attention_heads, vocab_size, ...).")
    h, n_layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv = _get(cfg, "num_key_value_heads", default=heads)
    head_dim = _get(cfg, "head_dim", default=h // heads)
    types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if types is None:
        sliding = window is not None and cfg.get("use_sliding_window", True)
        types = ["sliding_attention" if sliding else "full_attention"] * n_layers
    if len(types) != n_layers:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n_layers}.")
    # Gemma 4-style configs: per-layer overrides (``per_layer_config``, what the config object writes), or the
    # global layers' sizes as config.json fields.
    overrides = {int(i): o for i, o in (cfg.get("per_layer_config") or {}).items()}
    global_dim = _get(cfg, "global_head_dim", default=head_dim)
    global_kv = _get(cfg, "num_global_key_value_heads", default=kv)
    # Global layers share K and V when the config says so (Gemma 4's attention_k_eq_v), else as the family's models do.
    traits = planning.cost_traits(cfg)
    k_eq_v = bool(cfg.get("attention_k_eq_v", traits["k_eq_v"]))
    layers = []
    for i, t in enumerate(types):
        if i in overrides:
            o = overrides[i]
            sliding = t == "sliding_attention"
            layers.append(AttentionShape(o.get("num_attention_heads", heads), o.get("num_key_value_heads", kv),
                                         o.get("head_dim", head_dim), window if sliding else None,
                                         k_eq_v and not sliding))
        elif t == "sliding_attention":
            layers.append(AttentionShape(heads, kv, head_dim, window))
        else:
            layers.append(AttentionShape(heads, global_kv, global_dim, None, k_eq_v))
    layers = tuple(layers)
    experts = _get(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0
    top_k = _get(cfg, "top_k_experts", "num_experts_per_tok", default=0) or 0
    moe_i = _get(cfg, "moe_intermediate_size", default=0) or 0
    if experts and not (top_k and (moe_i or cfg.get("intermediate_size"))):
        raise ValueError(f"the MoE config {name!r} has num_experts={experts} but no top_k_experts / "
                         "num_experts_per_tok or moe_intermediate_size.")
    intermediate = _get(cfg, "intermediate_size", default=4 * h)
    if experts:
        moe_i = moe_i or intermediate
        # Gemma 4-style configs keep the dense MLP beside the experts; Qwen-MoE / Mixtral replace it (a shared
        # expert, when declared, is a dense MLP of its own width).
        intermediate = intermediate if cfg.get("enable_moe_block") else _get(
            cfg, "shared_expert_intermediate_size", default=0)
    B = block_size or _get(outer, "block_size", "canvas_length", default=32)
    clean = outer.get("clean_attention") or traits["clean_attention"]
    convention = outer.get("sliding_window_convention") or traits["window_convention"]
    return ModelSpec(name=name, hidden=h, vocab=cfg["vocab_size"], layers=layers, intermediate=intermediate,
                     num_experts=experts, top_k=top_k, moe_intermediate=moe_i,
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), block_size=B,
                     clean_attention=clean, window_convention=convention, head_on_clean=traits["head_on_clean"],
                     extra_params=traits["extra_params"])


def _gemma_layer_types(n: int, pattern: int = 6) -> list[str]:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


# Gemma 3 27B: the published config.json of google/gemma-3-27b-pt (text_config).
GEMMA3_27B = dict(
    model_type="block_diffusion", block_size=32, clean_attention="block_causal",
    backbone_config=dict(hidden_size=5376, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
                         head_dim=128, intermediate_size=21504, vocab_size=262208, sliding_window=1024,
                         layer_types=_gemma_layer_types(62), tie_word_embeddings=True))

def presets() -> dict[str, dict]:
    """The named configs ``--model`` accepts: ``gemma3-27b`` and every model family's
    (each family's planning role, ``PlanningSpec.presets``)."""
    found = {"gemma3-27b": GEMMA3_27B}
    for entry in REGISTRY:
        family = family_named(entry.name)
        if family.has_role("planning"):
            found.update(family.role("planning").presets())
    return found


def preset_names() -> tuple[str, ...]:
    """The names of :func:`presets`, read from the registry: no family module is imported (the ``hf-bdlm plan``
    parser lists them)."""
    return ("gemma3-27b",) + tuple(name for entry in REGISTRY for name in entry.planner_presets)


def model_spec(source, block_size: int | None = None) -> ModelSpec:
    """A preset name (:func:`presets`), a config dict / ``PreTrainedConfig``, or a ``config.json`` path / folder."""
    if isinstance(source, str) and source in presets():
        return spec_from_config(presets()[source], source, block_size)
    cfg, name = _load_config(source)
    return spec_from_config(cfg, name, block_size)
