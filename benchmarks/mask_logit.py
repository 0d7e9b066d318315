"""How often the [MASK] logit would win the engines' argmax, on held-out data, and what the export's correction does.

The `standard` objective leaves the [MASK] logit out of its softmax (BD3-LM's SUBS parameterization), so training
never pushes it down; `generate`'s own rule (`unmasking="hf_bdlm"`) drops it too. SGLang's LowConfidence and LMDeploy's
low_confidence_dynamic take the argmax and the softmax over the whole vocabulary. This measures, for a model trained
with `standard`, at the masked positions of held-out completions (the objective's own noise, seeded):

- how often the [MASK] logit is the argmax, and the probability the full softmax gives it;
- with the export's correction (the head's [MASK] row zero: the [MASK] logit is 0, every other logit unchanged): how
  often 0 beats every other logit, and how many threshold decisions (0.85, 0.9, 0.95; SGLang's `>`) differ from the
  [MASK]-free softmax the model was trained with;
- decoding held-out prompts with each engine's rule, the model as trained and corrected: completions holding [MASK]
  tokens, completions identical to `generate`'s own rule, exact match.

The model is the embedded SmolLM2-135M-Instruct (a Llama, tied embeddings, as Qwen3 up to 4B) converted with
`objective="standard"`: the measurement is about the objective's [MASK] logit, not about Qwen3.

    python -m benchmarks.mask_logit --model /tmp/standard30 --label "30 steps" --out benchmarks/results/mask_logit/trained.json
    python -m benchmarks.mask_logit --convert --label "converted, untrained" --out benchmarks/results/mask_logit/converted.json
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import time

import torch

THRESHOLDS = (0.85, 0.9, 0.95)


def load(args):
    from transformers import AutoModel, AutoTokenizer

    from hf_bdlm import convert_causal_lm
    from hf_bdlm.embedded import default_model_dir

    if args.convert:
        model, tokenizer = convert_causal_lm(str(default_model_dir()), block_size=args.block_size, objective="standard")
    else:
        model, tokenizer = AutoModel.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    if model.config.objective != "standard":
        raise SystemExit(f"the model was trained with objective={model.config.objective!r}; this measures 'standard'.")
    return model.eval(), tokenizer


def held_out(tokenizer, count: int):
    from hf_bdlm.data import load_arith

    rows = load_arith("test").select(range(count))
    examples = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True,
                                             return_dict=True)["input_ids"]
        examples.append({"prompt": list(prompt), "full": list(full), "answer": row["answer"]})
    return examples


@torch.no_grad()
def masked_position_logits(model, examples, seed: int = 0) -> torch.Tensor:
    """Logits (float32, whole vocabulary) at the masked positions of the held-out completions, each corrupted by the
    standard objective's own noise (seeded)."""
    from hf_bdlm import pad_to_block_multiple
    from hf_bdlm.objectives import get_objective

    config = model.config
    objective = get_objective("standard", config)
    pad = model.generation_config.pad_token_id
    pad = pad[0] if isinstance(pad, (list, tuple)) else (pad if pad is not None else 0)
    rows = []
    for index, example in enumerate(examples):
        ids = torch.tensor([example["full"]])
        completion = torch.zeros_like(ids)
        completion[:, len(example["prompt"]):] = 1
        ids = pad_to_block_multiple(ids, config.block_size, pad)
        completion = pad_to_block_multiple(completion, config.block_size, 0)
        batch = {"input_ids": ids, "completion_mask": completion, "sample_ids": torch.tensor([index])}
        corrupted = objective.corrupt(batch, seed=seed, step=0)
        logits = model(input_ids=corrupted.noisy_ids, clean_input_ids=corrupted.clean_ids).logits[0]
        rows.append(logits[corrupted.masked[0]].float())
    return torch.cat(rows)


def logit_statistics(logits: torch.Tensor, mask_id: int) -> dict:
    others = torch.arange(logits.shape[1]) != mask_id
    full = logits.softmax(-1)
    subs = logits[:, others].softmax(-1)  # what the model was trained with: [MASK] left out
    corrected = logits.clone()
    corrected[:, mask_id] = 0.0
    corrected_p = corrected.softmax(-1)
    best_other = logits[:, others].max(-1).values
    p_subs = subs.max(-1).values
    # the confidence an engine compares with the threshold: the argmax's probability under the full softmax
    p_full = full.max(-1).values
    p_corr = corrected_p.max(-1).values
    mask_wins = logits.argmax(-1) == mask_id
    mask_wins_corrected = best_other < 0
    flips = {}
    for threshold in THRESHOLDS:
        trained = p_subs > threshold
        flips[str(threshold)] = {
            "as_trained": int(((p_full > threshold) & ~mask_wins != trained).sum()),
            "corrected": int(((p_corr > threshold) & ~mask_wins_corrected != trained).sum()),
        }
    p_mask = full[:, mask_id]
    return {
        "positions": int(logits.shape[0]),
        "mask_is_argmax": int(mask_wins.sum()),
        "mask_is_argmax_fraction": float(mask_wins.float().mean()),
        "p_mask_median": float(p_mask.median()),
        "p_mask_p99": float(p_mask.quantile(0.99)),
        "p_mask_max": float(p_mask.max()),
        "mask_logit_median": float(logits[:, mask_id].median()),
        "best_other_logit_min": float(best_other.min()),
        "corrected_mask_is_argmax": int(mask_wins_corrected.sum()),
        "corrected_p_mask_max": float(corrected_p[:, mask_id].max()),
        "corrected_confidence_max_relative_change": float(((p_corr - p_subs) / p_subs).abs().max()),
        "threshold_decisions_differing_from_the_trained_softmax": flips,
    }


@torch.no_grad()
def decoding(model, tokenizer, examples, new_tokens: int, threshold: float) -> dict:
    from hf_bdlm.data import exact_match
    from hf_bdlm.models.block_diffusion.export_sdar import zero_mask_logit

    mask = model.config.mask_token_id
    corrected = zero_mask_logit(copy.deepcopy(model))
    runs = {"hf_bdlm": (model, "hf_bdlm")}
    for rule in ("sglang_low_confidence", "lmdeploy_low_confidence_dynamic"):
        runs[f"{rule}, as trained"] = (model, rule)
        runs[f"{rule}, corrected"] = (corrected, rule)
    outputs = {name: [] for name in runs}
    for example in examples:
        prompt = torch.tensor([example["prompt"]])
        for name, (m, rule) in runs.items():
            out = m.generate(prompt, max_new_tokens=new_tokens, unmasking=rule, confidence_threshold=threshold)
            outputs[name].append(out[0, prompt.shape[1]:].tolist())
    result = {}
    for name, completions in outputs.items():
        texts = [tokenizer.decode([t for t in c if t != mask], skip_special_tokens=True) for c in completions]
        result[name] = {
            "completions_with_mask": sum(mask in c for c in completions),
            "mask_tokens": sum(c.count(mask) for c in completions),
            "identical_to_hf_bdlm": sum(c == o for c, o in zip(completions, outputs["hf_bdlm"])),
            "exact_match": sum(exact_match(t, e["answer"]) for t, e in zip(texts, examples)) / len(examples),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a block-diffusion folder trained with objective='standard'")
    source.add_argument("--convert", action="store_true", help="the embedded SmolLM2, converted, not trained")
    parser.add_argument("--block-size", type=int, default=16, help="with --convert")
    parser.add_argument("--label", required=True, help="what the model is, for the record")
    parser.add_argument("--examples", type=int, default=100, help="held-out examples for the logit statistics")
    parser.add_argument("--decode-examples", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    start = time.perf_counter()
    model, tokenizer = load(args)
    examples = held_out(tokenizer, max(args.examples, args.decode_examples))
    logits = masked_position_logits(model, examples[: args.examples])
    record = {
        "label": args.label, "model": args.model or "embedded:smollm2 converted (objective='standard')",
        "block_size": model.config.block_size, "mask_token_id": model.config.mask_token_id,
        "tied_embeddings": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "held_out_examples": args.examples,
        "logits": logit_statistics(logits, model.config.mask_token_id),
        "decoding": {"examples": args.decode_examples, "new_tokens": args.new_tokens, "threshold": args.threshold,
                     "runs": decoding(model, tokenizer, examples[: args.decode_examples], args.new_tokens,
                                      args.threshold)},
        "seconds": round(time.perf_counter() - start, 1), "torch": torch.__version__,
    }
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
