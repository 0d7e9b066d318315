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

Models: the embedded SmolLM2-135M-Instruct (a Llama with tied embeddings, as Qwen3 up to 4B) converted with
`objective="standard"` (``--convert``: at conversion, before any training), a folder trained with `standard`
(``--model``), or ``--tiny-qwen3 STEPS``: a small Qwen3 (2 layers, hidden 128, tied embeddings, the SmolLM2 tokenizer)
trained from scratch with `standard` on the shipped tasks for STEPS steps (P = 1), then measured. Training SmolLM2
itself with `standard` on this shared 2-core machine took minutes per step: the small Qwen3 is what could be trained
far enough here. The measurement is about the objective's [MASK] logit.

    python -m hf_bdlm.models.block_diffusion.studies.mask_logit --convert --label "SmolLM2 converted, not trained" \
        --out converted.json
    python -m hf_bdlm.models.block_diffusion.studies.mask_logit --tiny-qwen3 300 --label "small Qwen3, 300 steps" \
        --out tiny_qwen3.json
    python -m hf_bdlm.models.block_diffusion.studies.mask_logit --summary benchmarks/results/mask_logit  # summary.md
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import tempfile
import time

import torch
from transformers import AutoModel, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from ....data import exact_match, load_arith
from ....embedded import default_model_dir
from ....objectives import get_objective
from ....trainer import BDLMSFTConfig, BDLMSFTTrainer
from ..conversion import convert_causal_lm
from ..inference.export_sdar import zero_mask_logit
from ..modeling import pad_to_block_multiple

THRESHOLDS = (0.85, 0.9, 0.95)


def train_tiny_qwen3(steps: int, block_size: int, output_dir: str):
    """A small Qwen3 trained from scratch with `standard` on the shipped tasks (one process); returns (model,
    tokenizer, the training log)."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model, tokenizer = convert_causal_lm(Qwen3ForCausalLM(config), tokenizer, block_size=block_size,
                                         objective="standard", attention_backend="dense")  # short rows: one call
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    args = BDLMSFTConfig(output_dir=output_dir, objective="standard", max_steps=steps, learning_rate=1e-3,
                         lr_scheduler_type="cosine", warmup_steps=20, per_device_train_batch_size=8, max_length=128,
                         logging_steps=50, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                         activation_checkpointing=False)
    trainer = BDLMSFTTrainer(model, args=args, train_dataset=load_arith("train"), processing_class=tokenizer)
    trainer.train()
    log = [{k: e[k] for k in ("step", "loss", "mean_token_accuracy") if k in e}
           for e in trainer.state.log_history if "loss" in e]
    return trainer.model.eval(), tokenizer, log


def load(args):
    if args.tiny_qwen3:
        model, tokenizer, log = train_tiny_qwen3(args.tiny_qwen3, args.block_size, tempfile.mkdtemp())
        args.training_log = log
        return model, tokenizer
    if args.convert:
        model, tokenizer = convert_causal_lm(str(default_model_dir()), block_size=args.block_size, objective="standard")
    else:
        model, tokenizer = AutoModel.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    if model.config.objective != "standard":
        raise SystemExit(f"the model was trained with objective={model.config.objective!r}; this measures 'standard'.")
    return model.eval(), tokenizer


def held_out(tokenizer, count: int):
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


def summary(folder: pathlib.Path) -> str:
    """``summary.md`` of the records in ``folder``: one column per model."""
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    lines = ["[MASK] logit of models trained with `standard`, at the masked positions of held-out completions (the "
             "objective's own noise), and in decoding (`python -m hf_bdlm.models.block_diffusion.studies.mask_logit`). "
             "'Corrected': the head's [MASK] row zero, as the SDAR export writes it.", "",
             "| | " + " | ".join(r["label"] for r in records) + " |", "|---|" + "---|" * len(records)]

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    row("model", [r["model"] for r in records])
    row("masked positions", [str(r["logits"]["positions"]) for r in records])
    row("[MASK] is the argmax, as trained", [f"{r['logits']['mask_is_argmax']} "
                                             f"({r['logits']['mask_is_argmax_fraction']:.1%})" for r in records])
    row("p([MASK]) under the full softmax: median / p99 / max",
        [f"{r['logits']['p_mask_median']:.3g} / {r['logits']['p_mask_p99']:.3g} / {r['logits']['p_mask_max']:.3g}"
         for r in records])
    row("[MASK] is the argmax, corrected", [str(r["logits"]["corrected_mask_is_argmax"]) for r in records])
    row("smallest best other logit (corrected [MASK] wins only below 0)",
        [f"{r['logits']['best_other_logit_min']:.3g}" for r in records])
    for threshold in THRESHOLDS:
        row(f"threshold {threshold} decisions differing from the trained softmax: as trained / corrected",
            [f"{r['logits']['threshold_decisions_differing_from_the_trained_softmax'][str(threshold)]['as_trained']} / "
             f"{r['logits']['threshold_decisions_differing_from_the_trained_softmax'][str(threshold)]['corrected']}"
             for r in records])
    runs = list(records[0]["decoding"]["runs"])
    settings = records[0]["decoding"]
    lines += ["", f"Decoding {settings['examples']} held-out prompts, {settings['new_tokens']} new tokens, threshold "
                  f"{settings['threshold']}: completions holding [MASK] tokens (tokens) / completions identical to "
                  "`unmasking='hf_bdlm'` / exact match.", "",
              "| rule | " + " | ".join(r["label"] for r in records) + " |", "|---|" + "---|" * len(records)]
    for name in runs:
        row(name, [f"{r['decoding']['runs'][name]['completions_with_mask']} ({r['decoding']['runs'][name]['mask_tokens']})"
                   f" / {r['decoding']['runs'][name]['identical_to_hf_bdlm']} / "
                   f"{r['decoding']['runs'][name]['exact_match']:.0%}" for r in records])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--summary"]:
        folder = pathlib.Path(argv[1])
        (folder / "summary.md").write_text(summary(folder))
        print((folder / "summary.md").read_text())
        return 0
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a block-diffusion folder trained with objective='standard'")
    source.add_argument("--convert", action="store_true", help="the embedded SmolLM2, converted, not trained")
    source.add_argument("--tiny-qwen3", type=int, metavar="STEPS", help="train a small Qwen3 for STEPS steps first")
    parser.add_argument("--block-size", type=int, default=16, help="with --convert or --tiny-qwen3")
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
    model_text = args.model or ("small Qwen3 (2 layers, hidden 128, tied, SmolLM2 tokenizer) trained from scratch, "
                                f"objective='standard', {args.tiny_qwen3} steps, batch 8, lr 1e-3"
                                if args.tiny_qwen3 else "embedded:smollm2 converted (objective='standard')")
    record = {
        "label": args.label, "model": model_text, "training_log": getattr(args, "training_log", None),
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
