"""Tiny offline DiffusionGemma fixtures for the block-parallel tests and workers.

The model of tests/models/diffusion_gemma/test_model.py (2 layers: sliding W = 6 then full, 4 heads, 2 K/V heads of 8,
4 experts top-2, canvas B = 4, vocab 64, a tiny vision tower), TRL's DiffusionGemma chat template on a word-level
tokenizer (tests/fixtures.py), batches whose responses start anywhere (plain and packed), and the float64 shims of the
exactness tests.
"""

from __future__ import annotations

import types

import datasets
import torch
from fixtures import word_tokenizer
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, Gemma4VisionConfig, PreTrainedTokenizerFast
from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig

B, W, VOCAB = 4, 6, 64
HKV, HEAD_DIM = 2, 8  # sliding and full layers alike
PAD, EOS, BOS, TURN_END = 0, 1, 2, 4
SPECIALS = ["[PAD]", "<eos>", "<bos>", "<|turn>", "<turn|>", "[UNK]"]
WORDS = ["user", "model", "system"] + [f"w{i}" for i in range(VOCAB - 9)]


def text_config() -> DiffusionGemmaTextConfig:
    return DiffusionGemmaTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=HKV, head_dim=HEAD_DIM, global_head_dim=HEAD_DIM, num_global_key_value_heads=HKV,
        layer_types=["sliding_attention", "full_attention"], sliding_window=W, num_experts=4, top_k_experts=2,
        moe_intermediate_size=16, max_position_embeddings=256, pad_token_id=PAD, eos_token_id=[EOS, TURN_END],
        bos_token_id=BOS,
    )


def tiny_model(seed: int = 0, vision_heads: int = 1) -> DiffusionGemmaForBlockDiffusion:
    """``vision_heads=2``: a vision tower that tensor parallelism of 2 can split (whole heads per rank)."""
    torch.manual_seed(seed)
    vision = Gemma4VisionConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                num_attention_heads=vision_heads, num_key_value_heads=vision_heads,
                                head_dim=8 // vision_heads, position_embedding_size=4, patch_size=2)
    config = DiffusionGemmaConfig(text_config=text_config(), vision_config=vision, canvas_length=B)
    return DiffusionGemmaForBlockDiffusion(config)


def float64_faithful(model: DiffusionGemmaForBlockDiffusion) -> DiffusionGemmaForBlockDiffusion:
    """The model in float64, computing in float64 throughout (test-only).

    transformers' DiffusionGemma rounds through float32 in its RMSNorms and router softmax, and its grouped_mm experts
    reject float64 on CPU: the same formulas without the casts, and the eager experts, keep reassociation-level
    differences visible (a float32 rounding would hide them behind ~1e-8).
    """
    model = model.double()
    model.config.text_config._experts_implementation = "eager"
    for module in model.modules():
        name = type(module).__name__
        if name == "DiffusionGemmaRMSNorm":
            def norm(self, x):
                y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
                return y * self.weight if self.with_scale else y

            module.forward = types.MethodType(norm, module)
        elif name == "DiffusionGemmaTextRouter":
            def route(self, hidden):
                hidden = self.norm(hidden) * self.scale * self.scalar_root_size
                probs = torch.softmax(self.proj(hidden), dim=-1)
                weights, index = torch.topk(probs, k=self.config.top_k_experts, dim=-1)
                weights = weights / weights.sum(dim=-1, keepdim=True)
                return probs, weights * self.per_expert_scale[index], index

            module.forward = types.MethodType(route, module)
    return model


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from trl.chat_template_utils import diffusion_gemma_chat_template

    return word_tokenizer(SPECIALS + WORDS, diffusion_gemma_chat_template, pad_token="[PAD]", bos_token="<bos>",
                          eos_token="<eos>", additional_special_tokens=["<|turn>", "<turn|>"])


def save_checkpoint(path, model: DiffusionGemmaForBlockDiffusion | None = None, denoising_steps: int = 8):
    """A checkpoint folder as our trainer writes it: ``model`` (default: the tiny model of seed 0) with a generation
    config of ``denoising_steps`` per canvas, and the word-level chat tokenizer."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    model = tiny_model(seed=0) if model is None else model
    model.generation_config = DiffusionGemmaGenerationConfig(max_denoising_steps=denoising_steps,
                                                             eos_token_id=[EOS, TURN_END], pad_token_id=PAD)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def conversations(n: int) -> datasets.Dataset:
    """``n`` conversations of 3-6 user words and 4-10 assistant words."""
    return datasets.Dataset.from_dict({"messages": [
        [{"role": "user", "content": " ".join(f"w{(3 * i + k) % 50}" for k in range(3 + i % 4))},
         {"role": "assistant", "content": " ".join(f"w{(5 * i + k) % 50}" for k in range(4 + (2 * i) % 7))}]
        for i in range(n)]})


def _document(length: int, response_start: int, generator: torch.Generator):
    ids = torch.randint(9, VOCAB, (length,), generator=generator)
    ids[-1] = TURN_END  # a complete response: its EOS fill is supervised
    completion = torch.zeros(length, dtype=torch.long)
    completion[response_start:] = 1
    return ids, completion


def make_batch(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """Two rows. ``plain``: one document each (45 and 30 tokens, responses from 9 and 17, right padding);
    ``packed``: row 0 packs two documents (20 + 26 tokens, responses from 8 and 10), row 1 holds one of 33."""
    g = torch.Generator().manual_seed(seed)
    rows = [[(45, 9)], [(30, 17)]] if kind == "plain" else [[(20, 8), (26, 10)], [(33, 12)]]
    length = max(sum(n for n, _ in docs) for docs in rows)
    ids = torch.full((2, length), PAD)
    attention, completion, document = (torch.zeros(2, length, dtype=torch.long) for _ in range(3))
    for i, docs in enumerate(rows):
        at = 0
        for d, (n, start) in enumerate(docs):
            x, m = _document(n, start, g)
            ids[i, at : at + n], attention[i, at : at + n], completion[i, at : at + n] = x, 1, m
            document[i, at : at + n] = d
            at += n
        document[i, at:] = len(docs)
    batch = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion,
             "sample_ids": torch.arange(2) + 1000 * seed}
    if kind == "packed":
        batch["document_ids"] = document
    return batch
