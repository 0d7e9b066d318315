"""DiffusionGemma on hf_bdlm's attention: every canvas block of a sequence in one encoder + decoder pass.

transformers' ``DiffusionGemmaForBlockDiffusion`` is trained as it is, never forked. At inference its causal encoder
reads the prefix into a KV cache and its bidirectional decoder denoises one canvas of ``canvas_length`` (B) tokens
over what the cache holds (full layers: the whole prefix; sliding layers: the last ``W - 1`` positions) plus the
canvas. Here the encoder reads the whole clean sequence once and the decoder denoises *all* response blocks at once;
our attention function gives each row exactly what it would see at inference:

| rows | attend to | rule (``hf_bdlm.attention.masks``, ``clean_attention="causal"``, ``"block_start"`` windows) |
|---|---|---|
| encoder (clean stream) | clean keys | ``k <= q``; sliding layers ``q - W + 1 <= k`` |
| decoder (noisy stream, the canvases) | clean keys | ``k < s_b``; sliding layers ``s_b - W + 1 <= k`` |
| decoder | noisy keys | its own block ``[s_b, s_b + B)`` |

The rule's blocks are ``pos // B``, so rows live in a *frame* where each document's response starts on a block
boundary (:func:`build_canvas_frame`): a document is shifted right by ``(-response_start) mod B`` pad rows, which no
real row sees (a document id of their own). Frame distances equal sequence distances, so windows are unchanged; RoPE
positions are the real ones. Only the canvas blocks are decoder rows (not a noisy copy of the prompt).

What transformers' code fixed, and how it is used without copying it:

- The decoder takes the encoder's K/V from ``cache`` (``append_to_cache`` concatenates the cached keys and the
  canvas keys) and calls the attention interface with ``[cached ; canvas]`` keys. A plain ``DynamicCache()`` (no
  config: no sliding layers) keeps the encoder's full K/V with their autograd history, so the diffusion loss reaches
  the encoder through them as in TRL's example. The layout splits the key rows back into the two sources.
- Attention is dispatched by ``config._attn_implementation``. :func:`use_block_diffusion_attention` registers
  ``"bdlm_diffusion_gemma+<fallback>"``: with a ``bdlm_layout`` kwarg it runs hf_bdlm's rule, without one it is the
  model's previous implementation (its masks too), so ``generate``, the vision tower and activation-checkpoint
  recomputation keep working. ``_attn_implementation`` is not saved: checkpoints stay plain DiffusionGemma.
- Self-conditioning enters the decoder as the previous pass's logits ``[b, canvas, vocab]`` (it forms soft
  embeddings itself). At long context that tensor would be the largest of the step, so the soft embeddings are
  computed here chunk by chunk (the same formula) and handed to the model's own ``self_conditioning`` block through a
  forward pre-hook that replaces the zero signal the decoder passes when it gets no logits.
- Logits are soft-capped in the model's top-level forward over the whole canvas; training applies ``lm_head`` and the
  same cap only on the rows it scores, in chunks.

Tiny CPU example (see ``tests/models/diffusion_gemma/test_model.py`` for the tiny config)::

    frame = build_canvas_frame(input_ids, attention_mask, completion_mask, block_size=4, fill_token_id=1)
    layout = DiffusionGemmaLayout.local(frame)
    encoder_hidden, cache = encode(model, frame, layout)
    canvas_hidden = decode(model, frame, layout, frame.canvas_target, cache)
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from transformers import AttentionInterface, DiffusionGemmaForBlockDiffusion, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
    DiffusionGemmaDecoderTextAttention,
    eager_attention_forward,
)

from ...attention.backends import attend
from ...attention.interface import bdlm_attention_forward
from ...attention.masks import CLEAN, NOISY, MaskRule
from ...attention.rows import RowMeta
from ...protocols.step import unwrap_model

ATTENTION_PREFIX = "bdlm_diffusion_gemma"
# LoRA of the reference fine-tune: attention and dense-MLP linears of the encoder and decoder layers (separate adapters
# on the tied weights, kept unmerged); the router, the experts, self-conditioning and the vision tower stay frozen.
DIFFUSION_GEMMA_LORA_TARGETS = (
    r"model\.(?:encoder\.language_model|decoder)\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)"
)
NO_MASKS = {"full_attention": None, "sliding_attention": None}
PAD_DOCUMENT = -1  # frame rows that hold no token of any document (shifts, dummy canvas blocks)


# --- the model --------------------------------------------------------------------------------------------------
def diffusion_gemma_class():
    return DiffusionGemmaForBlockDiffusion


def unwrap_diffusion_gemma(model):
    """The ``DiffusionGemmaForBlockDiffusion`` inside PEFT / DDP / training-step wrappers, or ``None``."""
    inner = unwrap_model(model)
    return inner if isinstance(inner, diffusion_gemma_class()) else None


def is_diffusion_gemma(model) -> bool:
    return unwrap_diffusion_gemma(model) is not None


def canvas_length(model) -> int:
    return int(unwrap_diffusion_gemma(model).config.canvas_length)


def use_block_diffusion_attention(model) -> str:
    """Route the model's attention through hf_bdlm when a layout is passed, else through its current implementation.

    Idempotent; returns the registered name. Raises for an encoder that is not causal
    (``use_bidirectional_attention="all"``): its inference is not the causal rule trained here.
    """
    dg = unwrap_diffusion_gemma(model)
    text = dg.config.text_config
    if getattr(text, "use_bidirectional_attention", None) == "all":
        raise ValueError(
            "this DiffusionGemma config has use_bidirectional_attention='all' (a bidirectional encoder); the "
            "diffusion_gemma objective trains the causal encoder DiffusionGemma runs at inference."
        )
    fallback = text._attn_implementation or "sdpa"
    if fallback.startswith(ATTENTION_PREFIX):
        return fallback
    name = f"{ATTENTION_PREFIX}+{fallback}"
    AttentionInterface.register(name, _dispatching_attention(fallback))
    if fallback in ALL_MASK_ATTENTION_FUNCTIONS:  # masks for generate, built as for the fallback
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[fallback])
    dg.config._attn_implementation = name  # the setter reaches text_config and vision_config
    return name


def _dispatching_attention(fallback: str):
    def forward(module, query, key, value, attention_mask, **kwargs):
        if kwargs.get("bdlm_layout") is not None:
            return bdlm_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if fallback == "eager":
            fn = eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[fallback]
        return fn(module, query, key, value, attention_mask, **kwargs)

    return forward


def is_decoder_attention(module: nn.Module) -> bool:
    """Whether an attention module is the decoder's (its keys: the encoder's cached clean rows, then the canvas)."""
    return isinstance(module, DiffusionGemmaDecoderTextAttention)


# --- the frame: where every row sits --------------------------------------------------------------------------
@dataclass
class CanvasFrame:
    """Rows of one batch for the all-blocks pass (pure geometry; the objective adds the noise).

    Clean stream (encoder), ``[b, F]``: ``clean_ids``, ``clean_positions`` (RoPE), ``clean_source`` (position in the
    collated row, -1 on pad rows), ``ar_pairs`` (row ``f`` predicts ``clean_ids[f + 1]``: both real, same document).
    Canvas (decoder), ``[b, Nc]`` with ``Nc = len(canvas_blocks) * B``: ``canvas_positions`` (RoPE),
    ``canvas_source`` (collated-row position of the canvas token, past the row's end for the EOS fill; -1 on dummy
    rows: a block some other row of the batch needs, or a padding block of a parallel layout), ``canvas_block_source`` (position of its block's first token),
    ``canvas_target`` (the clean canvas: response tokens, then the fill token), ``canvas_supervised``.
    ``clean_rows`` / ``canvas_rows`` are the attention rows (:class:`~hf_bdlm.attention.rows.RowMeta`, frame
    positions, per-row document ids).
    """

    block_size: int
    clean_ids: torch.Tensor
    clean_positions: torch.Tensor
    clean_source: torch.Tensor
    ar_pairs: torch.Tensor
    canvas_blocks: torch.Tensor
    canvas_positions: torch.Tensor
    canvas_source: torch.Tensor
    canvas_block_source: torch.Tensor
    canvas_target: torch.Tensor
    canvas_supervised: torch.Tensor
    clean_rows: RowMeta
    canvas_rows: RowMeta

    @property
    def frame_length(self) -> int:
        return int(self.clean_ids.shape[1])

    @property
    def num_canvas_rows(self) -> int:
        return int(self.canvas_target.shape[1])

    def to(self, device) -> "CanvasFrame":
        moved = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in self.__dict__.items()}
        moved["clean_rows"] = self.clean_rows.to(device)
        moved["canvas_rows"] = self.canvas_rows.to(device)
        return CanvasFrame(**moved)


@dataclass
class _Document:
    start: int  # first real token (collated-row position)
    length: int  # real tokens
    response: tuple[int, int] | None  # [r0, r1) of the last supervised span
    cut: bool  # the response was truncated: its EOS fill is not supervised


def _documents(attention: torch.Tensor, supervised: torch.Tensor, doc: torch.Tensor | None, row: int,
               ids: torch.Tensor, end_token_ids, truncated: bool | None) -> list[_Document]:
    length = attention.shape[0]
    if doc is None:
        segments = [(0, length)]
    else:
        change = (doc[1:] != doc[:-1]).nonzero().flatten().add(1).tolist()
        bounds = [0] + change + [length]
        segments = list(zip(bounds[:-1], bounds[1:]))
    docs = []
    for a, e in segments:
        real = attention[a:e].nonzero().flatten()
        if real.numel() == 0:
            continue
        first, last = int(real[0]) + a, int(real[-1]) + a
        if int(real.numel()) != last - first + 1:
            raise ValueError(
                f"batch row {row}: the real tokens of the document at positions {a}..{e - 1} are not contiguous "
                "(attention_mask has holes); DiffusionGemma training needs each document as one run of tokens."
            )
        sup = supervised[first : last + 1].nonzero().flatten()
        response = None
        cut = False
        if sup.numel():
            r1 = int(sup[-1]) + 1
            # The last contiguous supervised span: earlier assistant turns are context (TRL's reference recipe).
            gaps = (sup[1:] != sup[:-1] + 1).nonzero().flatten()
            r0 = int(sup[int(gaps[-1]) + 1]) if gaps.numel() else int(sup[0])
            response = (first + r0, first + r1)
            if truncated is not None:
                cut = bool(truncated)
            elif end_token_ids is not None:
                cut = int(ids[first + r1 - 1]) not in end_token_ids
        docs.append(_Document(first, last - first + 1, response, cut))
    return docs


class _PlacedDocument(NamedTuple):
    """A document of a batch row and where the frame puts it."""

    index: int  # the document's index in its batch row (its id in the frame's rows)
    doc: _Document
    at: int  # frame position of the document's first token
    canvas_blocks: int  # how many canvas blocks its response fills


class _CanvasBlock(NamedTuple):
    """One canvas block of a response: where its tokens come from in the collated row."""

    document: int  # index of the document in its batch row
    source_start: int  # collated position of the block's first token
    response_end: int  # collated position one past the response
    rope_start: int  # RoPE position of the block's first token
    cut: bool  # the response was truncated: the fill past it is not supervised


class _CleanStream(NamedTuple):
    """The encoder's rows ``[b, F]`` (see :class:`CanvasFrame`); ``doc`` is each row's document index."""

    ids: torch.Tensor
    positions: torch.Tensor
    source: torch.Tensor
    doc: torch.Tensor
    ar_pairs: torch.Tensor


class _CanvasStream(NamedTuple):
    """The decoder's rows ``[b, Nc]`` (see :class:`CanvasFrame`); ``doc`` is each row's document index."""

    positions: torch.Tensor
    source: torch.Tensor
    block_source: torch.Tensor
    target: torch.Tensor
    supervised: torch.Tensor
    doc: torch.Tensor


def _place_documents(docs: list[_Document], block_size: int) -> tuple[list[_PlacedDocument], int]:
    """Frame positions of one batch row's documents, and the row's frame length (a multiple of ``block_size``).

    Each document starts on a block boundary, shifted right so that its response starts on one too, and takes the
    blocks its tokens or its response's canvas blocks reach, whichever end later.
    """
    cursor, placed = 0, []
    for d, doc in enumerate(docs):
        shift = (-(doc.response[0] - doc.start)) % block_size if doc.response else 0
        at = cursor + shift
        end = at + doc.length
        blocks = 0
        if doc.response:
            r0, r1 = doc.response
            blocks = -(-(r1 - r0) // block_size)
            end = max(end, at + (r0 - doc.start) + blocks * block_size)
        placed.append(_PlacedDocument(d, doc, at, blocks))
        cursor = -(-end // block_size) * block_size
    return placed, cursor


def _padded_frame_length(frame_length: int, block_size: int, pad_to_multiple_of: int | None) -> int:
    """``frame_length`` rounded up to ``pad_to_multiple_of`` (default: the canvas length), which must be a multiple
    of the canvas length."""
    multiple = pad_to_multiple_of or block_size
    if multiple % block_size:
        raise ValueError(f"pad_to_multiple_of={multiple} must be a multiple of the canvas length {block_size}.")
    return -(-frame_length // multiple) * multiple


def _clean_stream(rows: list[list[_PlacedDocument]], ids: torch.Tensor, positions: torch.Tensor | None,
                  frame_length: int, pad_token_id: int) -> _CleanStream:
    """The encoder's ``[b, F]`` rows: every document's tokens at its frame position, pad rows elsewhere.

    RoPE positions are ``positions`` (collated, per row) when given, else restart at 0 at each document; ``ar_pairs``
    marks the rows whose next row is the next token of the same document.
    """
    b, F = len(rows), frame_length
    clean_ids = torch.full((b, F), pad_token_id, dtype=torch.long)
    clean_positions = torch.zeros((b, F), dtype=torch.long)
    clean_source = torch.full((b, F), -1, dtype=torch.long)
    clean_doc = torch.full((b, F), PAD_DOCUMENT, dtype=torch.long)
    ar_pairs = torch.zeros((b, F), dtype=torch.bool)
    for i, placed in enumerate(rows):
        for d, doc, at, _ in placed:
            src = torch.arange(doc.start, doc.start + doc.length)
            clean_ids[i, at : at + doc.length] = ids[i, src]
            rope = src - doc.start if positions is None else positions[i, src]
            clean_positions[i, at : at + doc.length] = rope
            clean_source[i, at : at + doc.length] = src
            clean_doc[i, at : at + doc.length] = d
            ar_pairs[i, at : at + doc.length - 1] = True
    return _CleanStream(clean_ids, clean_positions, clean_source, clean_doc, ar_pairs)


def _canvas_blocks(rows: list[list[_PlacedDocument]], positions: torch.Tensor | None,
                   block_size: int) -> dict[tuple[int, int], _CanvasBlock]:
    """The canvas blocks of every response, keyed by ``(batch row, frame block)``."""
    canvas = {}
    for i, placed in enumerate(rows):
        for d, doc, at, blocks in placed:
            if not doc.response:
                continue
            r0, r1 = doc.response
            first_block = (at + r0 - doc.start) // block_size
            rope0 = int(r0 - doc.start if positions is None else positions[i, r0])
            for j in range(blocks):
                canvas[(i, first_block + j)] = _CanvasBlock(d, r0 + j * block_size, r1, rope0 + j * block_size,
                                                            doc.cut)
    return canvas


def _decoder_block_indices(canvas: dict[tuple[int, int], _CanvasBlock], num_frame_blocks: int,
                           canvas_blocks_multiple_of: int | None) -> list[int]:
    """The sorted frame blocks the decoder runs: every block some row has a canvas in, plus, to reach a multiple of
    ``canvas_blocks_multiple_of``, the lowest frame blocks that no row has a canvas in."""
    used = sorted({blk for _, blk in canvas})
    if canvas_blocks_multiple_of and len(used) % canvas_blocks_multiple_of:
        wanted = -(-len(used) // canvas_blocks_multiple_of) * canvas_blocks_multiple_of
        free = sorted(set(range(num_frame_blocks)) - set(used))[: wanted - len(used)]
        if len(used) + len(free) < wanted:
            raise ValueError(
                f"the frame has {num_frame_blocks} blocks, too few to pad its {len(used)} canvas blocks to a multiple "
                f"of {canvas_blocks_multiple_of}; pad the frame to a multiple of {canvas_blocks_multiple_of} blocks "
                "too."
            )
        used = sorted(used + free)
    return used


def _canvas_stream(canvas: dict[tuple[int, int], _CanvasBlock], blocks: torch.Tensor, ids: torch.Tensor,
                   block_size: int, fill_token_id: int) -> _CanvasStream:
    """The decoder's ``[b, len(blocks) * B]`` rows: each canvas block at the slot of its frame block in ``blocks``.

    A canvas holds the response's tokens, then ``fill_token_id`` past its end; the fill is supervised unless the
    response was cut. Slots of a block a row has no canvas in are dummy rows (never supervised).
    """
    B = block_size
    b, length = ids.shape
    nc = int(blocks.numel()) * B
    offsets = torch.arange(B)
    canvas_positions = torch.zeros((b, nc), dtype=torch.long)
    canvas_source = torch.full((b, nc), -1, dtype=torch.long)
    canvas_block_source = torch.full((b, nc), -1, dtype=torch.long)
    canvas_target = torch.full((b, nc), fill_token_id, dtype=torch.long)
    canvas_supervised = torch.zeros((b, nc), dtype=torch.bool)
    canvas_doc = torch.full((b, nc), PAD_DOCUMENT, dtype=torch.long)
    slot = {int(blk): k for k, blk in enumerate(blocks.tolist())}
    for (i, blk), (d, q0, r1, rope0, cut) in canvas.items():
        sl = slice(slot[blk] * B, slot[blk] * B + B)
        q = q0 + offsets
        in_response = q < r1
        canvas_positions[i, sl] = rope0 + offsets
        canvas_source[i, sl] = q
        canvas_block_source[i, sl] = q0
        # The fill's source lies past the response, maybe past the row: clamped, and never read as a target.
        canvas_target[i, sl] = torch.where(in_response, ids[i, q.clamp(max=length - 1)], fill_token_id)
        canvas_supervised[i, sl] = in_response | (not cut)
        canvas_doc[i, sl] = d
    return _CanvasStream(canvas_positions, canvas_source, canvas_block_source, canvas_target, canvas_supervised,
                         canvas_doc)


def build_canvas_frame(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    supervised: torch.Tensor,
    *,
    block_size: int,
    fill_token_id: int,
    pad_token_id: int = 0,
    document_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    end_token_ids: set[int] | None = None,
    pad_to_multiple_of: int | None = None,
    canvas_blocks_multiple_of: int | None = None,
) -> CanvasFrame:
    """Lay out a collated batch for the all-blocks pass.

    Per document (a packed row holds several), the response is its last contiguous supervised span ``[r0, r1)``; it
    is cut into ``ceil((r1 - r0) / B)`` canvas blocks starting at ``r0``. The last block is filled with
    ``fill_token_id`` past ``r1``; the fill is supervised unless the response was truncated: ``truncated[row]`` when
    given, else (with ``end_token_ids``) when the response does not end with one of those tokens.

    Args:
        input_ids, attention_mask, supervised (`torch.Tensor` of shape `[b, L]`): the collated batch.
        block_size (`int`): the canvas length `B`.
        fill_token_id (`int`): token past the response end in the last canvas (EOS).
        document_ids (`torch.LongTensor` of shape `[b, L]`, *optional*): packed documents.
        position_ids (`torch.LongTensor` of shape `[b, L]`, *optional*): RoPE positions (default: restart at 0 at
            each document).
        pad_to_multiple_of (`int`, *optional*): frame length multiple (default `B`; parallel layouts need more).
        canvas_blocks_multiple_of (`int`, *optional*): pad the canvas blocks to a multiple of this count with dummy
            blocks (the lowest frame blocks that are no canvas; rows of their own document, never scored), so that
            block-parallel ranks get equal shares.
    """
    B = block_size
    attention = attention_mask.bool().cpu()
    sup = (supervised.bool() & attention_mask.bool()).cpu()
    ids_cpu = input_ids.cpu()
    docs_cpu = None if document_ids is None else document_ids.cpu()
    pos_cpu = None if position_ids is None else position_ids.cpu()
    rows = []
    frame_length = B
    for i in range(ids_cpu.shape[0]):
        docs = _documents(attention[i], sup[i], None if docs_cpu is None else docs_cpu[i], i, ids_cpu[i],
                          end_token_ids, None if truncated is None else bool(truncated[i]))
        placed, row_length = _place_documents(docs, B)
        rows.append(placed)
        frame_length = max(frame_length, row_length)
    F = _padded_frame_length(frame_length, B, pad_to_multiple_of)
    clean = _clean_stream(rows, ids_cpu, pos_cpu, F, pad_token_id)
    canvas = _canvas_blocks(rows, pos_cpu, B)
    blocks = torch.tensor(_decoder_block_indices(canvas, F // B, canvas_blocks_multiple_of), dtype=torch.long)
    noisy = _canvas_stream(canvas, blocks, ids_cpu, B, fill_token_id)
    nc = int(blocks.numel()) * B
    canvas_pos = (blocks[:, None] * B + torch.arange(B)).flatten()
    frame = CanvasFrame(
        block_size=B,
        clean_ids=clean.ids,
        clean_positions=clean.positions,
        clean_source=clean.source,
        ar_pairs=clean.ar_pairs,
        canvas_blocks=blocks,
        canvas_positions=noisy.positions,
        canvas_source=noisy.source,
        canvas_block_source=noisy.block_source,
        canvas_target=noisy.target,
        canvas_supervised=noisy.supervised,
        clean_rows=RowMeta(torch.full((F,), CLEAN, dtype=torch.long), torch.arange(F), clean.doc),
        canvas_rows=RowMeta(torch.full((nc,), NOISY, dtype=torch.long), canvas_pos, noisy.doc),
    )
    return frame.to(input_ids.device)


# --- the layout: what the attention function does with the rows ---------------------------------------------------
def diffusion_gemma_rule(block_size: int) -> MaskRule:
    """The rule of DiffusionGemma's inference: token-causal encoder, canvas windows from the block start."""
    return MaskRule(block_size, clean_attention="causal", window_convention="block_start")


@dataclass
class DiffusionGemmaLayout:
    """All rows on this device: the encoder's clean rows and the decoder's canvas rows.

    ``attend`` is called by every attention module of the model (through the registered attention function): an
    encoder module attends its clean queries over the clean keys; a decoder module receives ``[clean ; canvas]`` keys
    (the cache, then its own) and attends its canvas queries over both sources. A block-parallel rank's layout
    (:class:`hf_bdlm.models.diffusion_gemma.training.sharded.ShardedDiffusionGemmaLayout`) keeps this interface with only its rows:
    the encoder runs over its clean rows (the cache holds their K/V, which its layout gathers over the clean ring),
    the decoder over its canvas blocks, and ``DiffusionGemmaObjective.loss`` scores what it counts
    (``clean_index`` / ``canvas_index`` / ``clean_loss_index``).
    """

    clean_rows: RowMeta
    canvas_rows: RowMeta
    base_rule: MaskRule
    backend: str = "auto"
    encoder_cache: dict = field(default_factory=dict)
    decoder_cache: dict = field(default_factory=dict)
    # Rows this device runs (``None``: all of them, in frame order). A sharded layout sets: ``clean_index`` (frame
    # positions of its encoder rows), ``canvas_index`` (canvas slots of its decoder rows), ``clean_loss_index``
    # (which of its encoder rows it counts the next-token loss of: rows held on several ranks count on one).
    clean_index = None
    canvas_index = None
    clean_loss_index = None

    @classmethod
    def local(cls, frame: CanvasFrame, backend: str = "auto") -> "DiffusionGemmaLayout":
        return cls(frame.clean_rows, frame.canvas_rows, diffusion_gemma_rule(frame.block_size), backend)

    def attend(self, module, query, key, value, rule: MaskRule, scale: float) -> torch.Tensor:
        n_clean = self.clean_rows.num_rows
        if not is_decoder_attention(module):
            if not getattr(module, "is_causal", True):
                raise ValueError("the DiffusionGemma encoder must be causal for the diffusion_gemma objective.")
            return attend(self.backend, query, [(key, value)], self.clean_rows, [self.clean_rows], rule, scale,
                          self.encoder_cache)
        if key.shape[2] != n_clean + self.canvas_rows.num_rows:
            raise ValueError(
                f"the decoder got {key.shape[2]} key rows, expected {n_clean} cached clean rows + "
                f"{self.canvas_rows.num_rows} canvas rows: run the encoder with this layout and a DynamicCache() first."
            )
        # Canvas (local) first, then the encoder's clean keys: the order a sharded layout overlaps communication in.
        sources = [(key[:, :, n_clean:], value[:, :, n_clean:]), (key[:, :, :n_clean], value[:, :, :n_clean])]
        return attend(self.backend, query, sources, self.canvas_rows, [self.canvas_rows, self.clean_rows], rule,
                      scale, self.decoder_cache)


# --- running the model -------------------------------------------------------------------------------------------
def encode(model, frame: CanvasFrame, layout: DiffusionGemmaLayout):
    """The encoder over the clean frame: ``(last hidden state [b, F, h], cache holding its full K/V)``."""
    dg = unwrap_diffusion_gemma(model)
    use_block_diffusion_attention(dg)
    cache = DynamicCache()  # no config: every layer keeps all its keys (the decoder's rule picks the window)
    ids, positions = _held(layout.clean_index, frame.clean_ids, frame.clean_positions)
    out = dg.model.encoder(input_ids=ids, position_ids=positions, attention_mask=NO_MASKS, cache=cache,
                           bdlm_layout=layout)
    return out.last_hidden_state, cache


def decode(model, frame: CanvasFrame, layout: DiffusionGemmaLayout, canvas_ids: torch.Tensor, cache,
           self_conditioning: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder over the canvas rows the layout holds: last hidden state ``[b, n, h]``.

    ``canvas_ids`` (``[b, Nc]``) is the whole canvas; ``self_conditioning`` (``[b, n, h]``, from
    :func:`self_conditioning_embeddings`) is the soft-embedding signal of a previous pass over the same rows;
    ``None`` is the model's first denoising step (a zero signal).
    """
    dg = unwrap_diffusion_gemma(model)
    decoder = dg.model.decoder
    ids, positions = _held(layout.canvas_index, canvas_ids, frame.canvas_positions)
    with _self_conditioning_signal(decoder, self_conditioning):
        out = decoder(decoder_input_ids=ids, cache=cache, decoder_attention_mask=NO_MASKS,
                      decoder_position_ids=positions, bdlm_layout=layout)
    return out.last_hidden_state


def _held(index, *tensors):
    """The columns ``index`` of ``[b, T]`` tensors (all of them for ``None``)."""
    if index is None:
        return tensors
    return tuple(t[:, index.to(t.device)] for t in tensors)


@contextmanager
def _self_conditioning_signal(decoder, signal):
    if signal is None:
        yield
        return

    def hook(module, args):
        inputs_embeds, zeros = args  # the decoder passes zeros when it is given no logits
        return inputs_embeds, signal.to(zeros.dtype)

    handle = decoder.self_conditioning.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def softcapped_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """``lm_head`` then the final soft cap, in float32 (as the model's forward computes its logits; float64 stays)."""
    dg = unwrap_diffusion_gemma(model)
    logits = dg.lm_head(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    cap = dg.final_logit_softcapping
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


@torch.no_grad()
def self_conditioning_embeddings(model, hidden: torch.Tensor, enabled: torch.Tensor, chunk: int = 4096):
    """Soft embeddings of the logits of ``hidden`` (``[b, n, h]``), zero for rows of samples not ``enabled``.

    The decoder's own formula (``softmax(logits) @ embed_tokens.weight * embed_scale``) over ``chunk`` rows at a
    time, so no ``[n, vocab]`` tensor lives longer than one chunk.
    """
    dg = unwrap_diffusion_gemma(model)
    embed = dg.model.decoder.embed_tokens
    weight = embed.weight
    scale = embed.embed_scale.to(weight.dtype)
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.empty(flat.shape[0], weight.shape[1], dtype=weight.dtype, device=hidden.device)
    split = isinstance(weight, DTensor)  # tensor parallelism: the embedding split by vocabulary (its local rows)
    for start in range(0, flat.shape[0], chunk):
        logits = softcapped_logits(dg, flat[start : start + chunk])
        probs = logits.softmax(dim=-1).to(weight.dtype)  # logits are float32 (float64 models: float64)
        if split:  # each rank its vocabulary slice of the product, summed over the tensor-parallel group
            probs = DTensor.from_local(probs, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim,
                                       run_check=False)
            out[start : start + chunk] = torch.matmul(probs, weight).full_tensor() * scale
        else:
            out[start : start + chunk] = torch.matmul(probs, weight) * scale
    out = out.view(*hidden.shape[:-1], weight.shape[1])
    return out * enabled.to(out.dtype)[:, None, None]


__all__ = [
    "ATTENTION_PREFIX",
    "DIFFUSION_GEMMA_LORA_TARGETS",
    "CanvasFrame",
    "DiffusionGemmaLayout",
    "build_canvas_frame",
    "canvas_length",
    "decode",
    "diffusion_gemma_rule",
    "encode",
    "is_decoder_attention",
    "is_diffusion_gemma",
    "self_conditioning_embeddings",
    "softcapped_logits",
    "unwrap_diffusion_gemma",
    "use_block_diffusion_attention",
]
