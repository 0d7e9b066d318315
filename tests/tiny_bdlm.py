"""A tiny random block-diffusion checkpoint folder with a word-level tokenizer and a chat template, built offline.

Used by the serving and evaluation tests: `save_tiny_bdlm(path)` writes weights, config, generation config and
tokenizer; `hf_bdlm.serving.Engine.from_pretrained(path)` loads it like any checkpoint. `save_tiny_target(path)` writes
a tiny random causal Llama of the same vocabulary and tokenizer (a speculative decoder's target).
"""

from __future__ import annotations

from pathlib import Path

import torch
from fixtures import tiny_target, word_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.protocols.policy import PolicyBatch

VOCAB, MASK, BLOCK, CONTEXT = 64, 63, 4, 256
WORDS = ["[UNK]", "[PAD]", "<s>", "</s>", "user", "assistant", "system"] + [f"w{i}" for i in range(7, MASK)] + [
    "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer(WORDS, CHAT_TEMPLATE, pad_token="[PAD]", bos_token="<s>", eos_token="</s>",
                          mask_token="<|mask|>")


def tiny_bdlm(seed: int = 0, context: int = CONTEXT) -> BlockDiffusionForMaskedLM:
    torch.manual_seed(seed)
    backbone = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, max_position_embeddings=context,
                           bos_token_id=2, eos_token_id=3, pad_token_id=1)
    config = BlockDiffusionConfig(backbone_config=backbone, block_size=BLOCK, mask_token_id=MASK)
    model = BlockDiffusionForMaskedLM(config).eval()
    # No EOS: a random model would stop at random places; lengths stay exactly max_tokens.
    model.generation_config.eos_token_id = None
    return model


def save_tiny_bdlm(path: str | Path, context: int = CONTEXT) -> Path:
    path = Path(path)
    tiny_bdlm(context=context).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def save_tiny_target(path: str | Path, num_hidden_layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A tiny random causal Llama (seeded ``seed``) of this vocabulary, saved to ``path`` with :func:`tiny_tokenizer`;
    the model is returned (a drafter is made from it)."""
    target = tiny_target("llama", seed=seed, training=True, vocab_size=VOCAB, num_hidden_layers=num_hidden_layers,
                         max_position_embeddings=CONTEXT, bos_token_id=2, eos_token_id=3, pad_token_id=1)
    target.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return target


def padded_batch(prompts, completions, rows) -> PolicyBatch:
    """TRL's layout of the rows: prompts left-padded, completions right-padded."""
    P, C, n = max(map(len, prompts)), max(map(len, completions)), len(prompts)
    prompt_ids, prompt_mask = torch.ones(n, P, dtype=torch.long), torch.zeros(n, P, dtype=torch.long)
    ids, mask = torch.ones(n, C, dtype=torch.long), torch.zeros(n, C, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[i, P - len(p):], prompt_mask[i, P - len(p):] = torch.tensor(p), 1
        ids[i, :len(c)], mask[i, :len(c)] = torch.tensor(c), 1
    return PolicyBatch(prompt_ids, prompt_mask, ids, mask, rows, max(len(p) + len(c) for p, c in zip(prompts,
                                                                                                      completions)))
