"""A tiny Qwen3 with Qwen3's real vocabulary layout, built offline: the stand-in for SDAR export tests.

Qwen3's tokenizer has 151643 ordinary tokens and 26 special ones (151643 `<|endoftext|>` .. 151668 `</think>`), and
its embedding 151936 rows: rows 151669 and up are unused, and 151669 is the `[MASK]` SGLang and LMDeploy hard-code.
`qwen3_layout_tokenizer()` has exactly those ids (word-level: the ordinary tokens are `t0` .. `t151642`, the special
ones Qwen3's strings); `tiny_qwen3(tie)` is a 2-layer `Qwen3ForCausalLM` of hidden size 32 with the 151936-row
embedding (4.9M parameters per embedding matrix).
"""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

ORDINARY = 151643
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                 "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                 "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
ROWS = 151936
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


@functools.lru_cache(maxsize=1)
def _backend_json() -> str:
    vocab = {f"t{i}": i for i in range(ORDINARY)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend.to_str()


def qwen3_layout_tokenizer() -> PreTrainedTokenizerFast:
    """151669 tokens with Qwen3's special tokens at Qwen3's ids (a fresh object each call)."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_backend_json()))
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN3_SPECIAL})  # in Qwen3's order: Qwen3's ids
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == ORDINARY + len(QWEN3_SPECIAL) == 151669
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "</think>")] \
        == [ENDOFTEXT, IM_START, IM_END, 151668]
    return tokenizer


def tiny_qwen3(tie: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Qwen3ForCausalLM:
    """A 2-layer Qwen3 (hidden 32, 4 heads, 2 K/V heads of 8, RoPE base 1e6) with Qwen3's 151936-row vocabulary."""
    torch.manual_seed(seed)
    config = Qwen3Config(**{**dict(
        vocab_size=ROWS, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rope_parameters={
            "rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=tie,
        bos_token_id=ENDOFTEXT, eos_token_id=IM_END, pad_token_id=ENDOFTEXT), **overrides})
    model = Qwen3ForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = [IM_END, ENDOFTEXT]
    model.generation_config.pad_token_id = ENDOFTEXT
    model.generation_config.bos_token_id = ENDOFTEXT
    return model


def sharpen_head(model, factor: float = 100.0) -> None:
    """Scale the LM head (untied) so that random logits are peaked: some positions pass a threshold, others do not.

    A random 151936-way softmax is nearly flat; the decoding rules' thresholds would never be reached."""
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        raise ValueError("sharpen an untied head only (scaling a tied one scales the input embedding too)")
    with torch.no_grad():
        head.weight.mul_(factor)
