"""Tiny offline fixtures shared by the trainer tests (tests/trainer/) and the trainer workers.

A word-level tokenizer with a ChatML-like chat template (``{% generation %}`` markers, so
``assistant_only_loss`` works), a 2-layer Llama block-diffusion model, and small datasets in
every TRL SFT format.
"""

from __future__ import annotations

import datasets
import torch
from fixtures import tiny_target, word_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM

SPECIALS = ["[PAD]", "[UNK]", "<s>", "</s>", "[MASK]", "<|im_start|>", "<|im_end|>"]
WORDS = (["user", "assistant", "system"] + [str(d) for d in range(10)]
         + "what is the sum of and plus minus sort count letters in word answer a b c d e f g h yes no".split())
PAD, MASK = 0, 4

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer(SPECIALS + WORDS, CHAT_TEMPLATE, pad_token="[PAD]", bos_token="<s>", eos_token="</s>",
                          mask_token="[MASK]", additional_special_tokens=["<|im_start|>", "<|im_end|>"])


def vocab_size() -> int:
    return len(SPECIALS) + len(WORDS)


# The backbone of the trainer tests' models: a 2-layer Llama over the tiny tokenizer's vocabulary.
LLAMA = dict(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=48, head_dim=8, pad_token_id=PAD, bos_token_id=2, eos_token_id=3)


def llama_config(**kw) -> LlamaConfig:
    return LlamaConfig(**{**LLAMA, **kw})


def tiny_bdlm(block_size: int = 4, objective: str = "standard", seed: int = 0, **kw) -> BlockDiffusionForMaskedLM:
    torch.manual_seed(seed)
    cfg = BlockDiffusionConfig(backbone_config=llama_config(), block_size=block_size, mask_token_id=MASK,
                               objective=objective, **kw)  # the clean stream follows the objective
    return BlockDiffusionForMaskedLM(cfg)


def tiny_causal_lm(seed: int = 0) -> LlamaForCausalLM:
    return tiny_target("llama", seed=seed, training=True, **LLAMA)


def _question(i: int) -> tuple[str, str]:
    a, b = i % 7, (3 * i) % 5
    words = "yes no a b c d e f g h".split()
    # Answers of 3 to 8 tokens, so that every small batch has masked targets at any masking rate.
    return f"what is the sum of {a} and {b}", " ".join([str(a + b)] + words[i % 4 : i % 4 + 2 + i % 6])


def prompt_completion(n: int = 12, conversational: bool = True, long_every: int = 0) -> datasets.Dataset:
    rows = {"prompt": [], "completion": []}
    for i in range(n):
        q, a = _question(i)
        if long_every and i % long_every == 0:
            q = q + " plus 1" * 20
        if conversational:
            rows["prompt"].append([{"role": "user", "content": q}])
            rows["completion"].append([{"role": "assistant", "content": a}])
        else:
            rows["prompt"].append(q + " answer")
            rows["completion"].append(" " + a)
    return datasets.Dataset.from_dict(rows)


def messages(n: int = 12) -> datasets.Dataset:
    rows = []
    for i in range(n):
        q, a = _question(i)
        rows.append([{"role": "system", "content": "answer yes or no"}, {"role": "user", "content": q},
                     {"role": "assistant", "content": a}, {"role": "user", "content": "sort the letters"},
                     {"role": "assistant", "content": "a b c"}])
    return datasets.Dataset.from_dict({"messages": rows})


def language_modeling(n: int = 12) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": [" ".join(_question(i)) + " yes" * (i % 5) for i in range(n)]})


def long_documents(n: int = 4, words: int = 900) -> datasets.Dataset:
    """Language-modeling rows of about ``words`` tokens: long enough that sharded K/V are in flight for a while."""
    texts = []
    for i in range(n):
        parts = []
        while len(parts) < words:
            q, a = _question(i + len(parts))
            parts += (q + " " + a).split()
        texts.append(" ".join(parts[:words]))
    return datasets.Dataset.from_dict({"text": texts})
