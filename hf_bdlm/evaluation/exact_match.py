"""Held-out exact match: generate an answer to each held-out prompt with the model's own `generate`, score it with
:func:`hf_bdlm.data.exact_match`. One scorer for every model family: the SFT recipe's before/after score, the
reload check and the matched comparison's per-checkpoint point all call it.

    score, answers = held_out_exact_match(model, tokenizer, test_examples[:8])            # one block per prompt
    score, _ = held_out_exact_match(model, tokenizer, test_examples[:8], seed=0)           # reproducible canvases
"""

from __future__ import annotations

import torch

from ..data import exact_match
from ..progress import progress_bar
from ..protocols.registry import family_for_model


@torch.no_grad()
def held_out_exact_match(model, tokenizer, examples, *, max_new_tokens: int | None = None,
                         seed: int | None = None, progress: bool = True) -> tuple[float, list[str]]:
    """Fraction of ``examples`` (conversational ``prompt``, ``answer``) whose greedy answer matches exactly, and the
    answers.

    Args:
        model: A model of any registered family (`hf_bdlm.models`), unwrapped.
        tokenizer: Its tokenizer; prompts go through its chat template with the generation prompt.
        examples (`list[dict]`): Held-out examples with ``prompt`` (a list of messages) and ``answer``.
        max_new_tokens (`int`, *optional*): Generation budget per prompt; defaults to one block of the model's family
            (``ModelFamily.block_size``: a converted model's ``block_size``, an encoder-decoder's canvas length).
        seed (`int`, *optional*): Decode each prompt after ``torch.manual_seed(seed)`` inside a forked random stream,
            so that a family whose sampler starts from a random canvas scores the weights, not the stream; the
            caller's generators are left as they were. Without it the model's decoding uses the global stream.
        progress (`bool`, defaults to `True`): A bar over the prompts on standard error (:mod:`hf_bdlm.progress`:
            on a terminal, on rank 0).

    The model's train/eval mode is restored.
    """
    if max_new_tokens is None:
        max_new_tokens = family_for_model(model).block_size(model)
    was_training = model.training
    model.eval()
    hits, answers = 0, []
    try:
        for example in progress_bar(examples, desc="held-out exact match", unit="prompt", enabled=progress):
            prompt = tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
            prompt = torch.tensor([list(prompt)], device=model.device)
            if seed is None:
                out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
            else:
                with torch.random.fork_rng(devices=[model.device.index or 0] if model.device.type == "cuda" else []):
                    torch.manual_seed(seed)
                    out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
            sequences = getattr(out, "sequences", out)  # some families return an output object
            text = tokenizer.decode(sequences[0, prompt.shape[1]:], skip_special_tokens=True)
            answers.append(text)
            hits += exact_match(text, example["answer"])
    finally:
        model.train(was_training)
    return hits / max(1, len(examples)), answers
