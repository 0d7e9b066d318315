"""What SGLang and LMDeploy compute for an SDAR export, on CPU: the reference that `hf_bdlm`'s export and decoding
strategies are checked against, and the decoder equivalence table.

Neither engine runs here (both need CUDA kernels), so the reference is assembled from what they are made of:

- the forward: the exported weights loaded strictly into transformers' own `Qwen3ForCausalLM` (the layers SGLang's
  `srt/models/sdar.py` and LMDeploy's `pytorch/models/sdar.py` implement), run over ``[clean prefix ; block]`` with the
  block-causal mask both engines apply (query ``q`` sees key ``k`` iff ``k // B <= q // B``: SGLang runs every extend
  as one non-causal block over the cached K/V, LMDeploy's block-sparse kernel tests exactly this), positions from 0;
- SGLang 0.5.23's `LowConfidence` transcribed from `srt/dllm/algorithm/low_confidence.py` (`step`) and `base.py`
  (`_run_sync`: at most block size + 1 steps, a block done after a forward whose ids hold no mask), with the request
  layout of `srt/dllm/mixin/req.py` (``prompt + output + [MASK] * B``, blocks aligned at 0, the prompt's tail left
  alone in the first block) and the first-EOS cut of `srt/dllm/mixin/scheduler.py`;
- LMDeploy 0.18.0's `low_confidence_dynamic`, either transcribed from `pytorch/strategies/dllm/unmasking.py` or its own
  `UnmaskingProcessor`, imported from the released wheel (:func:`lmdeploy_unmasking_module`), driving the block state
  as LMDeploy's sequence does (`pytorch/strategies/dllm/sequence.py`: the prompt padded with masks to a block multiple,
  a block all unmasked becomes cached at the next step).

    python scripts/sdar_engines.py --out-dir benchmarks/results/sdar_export     # logits and the table (minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import types
from collections.abc import Callable

import torch

LMDEPLOY_VERSION = "0.18.0"
# LMDeploy's block states (lmdeploy/pytorch/consts.py).
DLLM_MASKED, DLLM_UNMASKED, DLLM_CACHED = 0, 1, 2


# --- the forward -----------------------------------------------------------------------------------------------------
def load_reference_qwen3(folder: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """transformers' `Qwen3ForCausalLM` with an SDAR folder's weights, loaded strictly (every tensor used, none missing)."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = pathlib.Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
              "attention_bias", "tie_word_embeddings")
    config = Qwen3Config(**{k: raw[k] for k in fields},
                         rope_parameters={"rope_type": "default", "rope_theta": raw["rope_theta"]})
    model = Qwen3ForCausalLM(config).eval()
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    if raw["tie_word_embeddings"]:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.to(dtype)


def block_causal_bias(length: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, L, L]`` additive mask: 0 where ``k // B <= q // B``, the dtype's minimum elsewhere."""
    block = torch.arange(length) // block_size
    allowed = block[None, :] <= block[:, None]
    bias = torch.zeros(length, length, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return bias[None, None]


@torch.no_grad()
def engine_logits(qwen3, ids: list[int] | torch.Tensor, block_size: int) -> torch.Tensor:
    """Logits ``[L, vocab]`` of ``ids`` under the engines' attention (block-causal from position 0)."""
    ids = torch.as_tensor(ids, dtype=torch.long)[None]
    length = ids.shape[1]
    dtype = qwen3.get_input_embeddings().weight.dtype
    out = qwen3(input_ids=ids, attention_mask=block_causal_bias(length, block_size, dtype),
                position_ids=torch.arange(length)[None])
    return out.logits[0].float()


def block_forward(qwen3, block_size: int) -> Callable[[list[int], int], torch.Tensor]:
    """``forward(ids, start)``: the logits of the block ``ids[start:start + B]`` over the clean prefix ``ids[:start]``."""
    def forward(ids, start):
        return engine_logits(qwen3, list(ids)[: start + block_size], block_size)[start:start + block_size]
    return forward


@torch.no_grad()
def our_inference_logits(model, prefix: list[int], block: list[int]) -> torch.Tensor:
    """Logits ``[len(prefix) + B, vocab]`` of an hf_bdlm model at inference: the clean prefix (rows form, the model's
    attention rule) and the noisy block over the cached prefix (`generate`'s own `CachedContext`)."""
    from hf_bdlm.attention import CLEAN, LocalLayout, RowMeta
    from hf_bdlm.models.block_diffusion.generation import BlockDiffusionGenerationConfig, CachedContext, resolve_settings

    start = len(prefix)
    settings = resolve_settings(model, BlockDiffusionGenerationConfig(), start)
    rows = RowMeta(torch.full((start,), CLEAN), torch.arange(start))
    clean = model(input_ids=torch.tensor([prefix]), position_ids=torch.arange(start)[None],
                  bdlm_layout=LocalLayout(rows, rows, model.mask_rule(), "dense")).logits[0]
    context = CachedContext(model, settings, torch.device("cpu"))
    context.append(torch.tensor([prefix]))
    hidden, _ = context.block_hidden(torch.tensor([block]), start)
    return torch.cat([clean, model.lm_logits(hidden)[0]]).float()


def logits_difference(model, folder, prefix: list[int], block: list[int]) -> dict:
    """Our inference logits against the export's in transformers' Qwen3 under the engines' mask: the largest absolute
    difference over every column but [MASK], the largest logit, and the export's largest |[MASK] logit|."""
    mask = model.config.mask_token_id
    engine = engine_logits(load_reference_qwen3(folder), prefix + block, model.config.block_size)
    ours = our_inference_logits(model, prefix, block)
    others = torch.arange(engine.shape[1]) != mask
    return {"max_abs_difference": float((engine[:, others] - ours[:, others]).abs().max()),
            "max_abs_logit": float(ours.abs().max()), "export_mask_logit_max_abs": float(engine[:, mask].abs().max()),
            "mask_logit_max_abs_difference": float((engine[:, mask] - ours[:, mask]).abs().max())}


# --- SGLang's LowConfidence ------------------------------------------------------------------------------------------
def sglang_low_confidence(forward, prompt: list[int], block_size: int, threshold: float, max_new_tokens: int,
                          mask_id: int, eos_ids=()) -> dict:
    """Greedy decoding as SGLang 0.5.23 serves an SDAR request with ``--dllm-algorithm LowConfidence``.

    Returns ``{"tokens": the output ids, "steps": denoising steps per block, "parallel_steps": steps that fixed
    more than one position}``."""
    seq = list(prompt)
    start = len(prompt) - len(prompt) % block_size
    output, steps, parallel = [], [], 0
    while True:
        tail = len(seq) - start
        block = seq[start:] + [mask_id] * (block_size - tail)
        prompt_mask = torch.arange(block_size) < tail  # dllm_prompt_mask: never changed
        count = 0
        for _ in range(block_size + 1):  # DllmAlgorithm.max_steps
            ids = torch.tensor(block)
            masked = (ids == mask_id) & ~prompt_mask
            if not masked.any():  # `done` is read before the step: this forward saw the finished block
                break
            logits = forward(seq[:start] + block, start)
            x = logits.argmax(-1)
            confidence = logits.softmax(-1).gather(-1, x[:, None])[:, 0]
            confidence = torch.where(masked, confidence, torch.tensor(-float("inf")))
            transfer = confidence > threshold
            if not transfer.any():
                transfer = torch.zeros_like(transfer)
                transfer[int(confidence.argmax())] = True  # first index on ties
            x = torch.where(masked, x, ids)
            new = torch.where(transfer, x, ids)
            parallel += int(((new != ids) & masked).sum() > 1)
            block = new.tolist()
            count += 1
        steps.append(count)
        new_tokens = block[tail:]
        for i, token in enumerate(new_tokens):
            if token in eos_ids:  # the first stop token ends the output and is kept
                new_tokens = new_tokens[: i + 1]
                output += new_tokens
                return {"tokens": output[:max_new_tokens], "steps": steps, "parallel_steps": parallel}
        output += new_tokens
        if len(output) >= max_new_tokens:
            return {"tokens": output[:max_new_tokens], "steps": steps, "parallel_steps": parallel}
        seq = seq[:start] + block
        start += block_size


# --- LMDeploy's low_confidence_dynamic -------------------------------------------------------------------------------
def lmdeploy_dynamic_transcribed(block_size: int, threshold: float) -> Callable:
    """``unmask(logits, input_ids, token_ids, dllm_mask) -> (dllm_mask, token_ids)`` as LMDeploy 0.18.0's
    `UnmaskingProcessor.__call__` with `low_confidence_dynamic`, one block."""
    def unmask(logits, input_ids, token_ids, dllm_mask):
        dllm_mask = dllm_mask.clone()
        if (dllm_mask == DLLM_UNMASKED).all():
            dllm_mask[:] = DLLM_CACHED  # a block unmasked at the last step is committed now
        token_ids = torch.where(dllm_mask != DLLM_MASKED, input_ids, token_ids)
        scores = logits.softmax(-1).gather(-1, token_ids[:, None])[:, 0]
        is_masked = dllm_mask == DLLM_MASKED
        scores = torch.where(is_masked, scores, torch.zeros(()))
        scores[int(scores.argmax())] = threshold  # the top-1 always passes
        dllm_mask[is_masked & (scores >= threshold)] = DLLM_UNMASKED
        return dllm_mask, token_ids
    return unmask


def lmdeploy_dynamic_released(module, block_size: int, threshold: float) -> Callable:
    """The same callable, computed by LMDeploy's own `UnmaskingProcessor` (``module``: its `unmasking` module)."""
    from lmdeploy.pytorch.config import DLLMConfig, UnmaskingStrategy  # importable once `module` is

    processor = module.UnmaskingProcessor(DLLMConfig(block_length=block_size,
                                                     unmasking_strategy=UnmaskingStrategy.LOW_CONFIDENCE_DYNAMIC,
                                                     denoising_steps=block_size, confidence_threshold=threshold))

    def unmask(logits, input_ids, token_ids, dllm_mask):
        mask, tokens = processor(logits, input_ids, token_ids, dllm_mask.clone())
        return mask, tokens
    return unmask


def lmdeploy_decode(forward, prompt: list[int], block_size: int, max_new_tokens: int, mask_id: int,
                    unmask: Callable) -> dict:
    """Greedy decoding as LMDeploy 0.18.0's PyTorch engine serves an SDAR request, the unmasking rule ``unmask``."""
    seq = list(prompt)
    start = len(prompt) - len(prompt) % block_size
    output, steps, parallel = [], [], 0
    while len(output) < max_new_tokens:
        tail = len(seq) - start
        ids = torch.tensor(seq[start:] + [mask_id] * (block_size - tail))
        state = torch.tensor([DLLM_UNMASKED] * tail + [DLLM_MASKED] * (block_size - tail), dtype=torch.uint8)
        count = 0
        while True:
            logits = forward(seq[:start] + ids.tolist(), start)
            state_after, tokens = unmask(logits, ids, logits.argmax(-1), state)
            if (state_after == DLLM_CACHED).all():
                break
            parallel += int(((state_after == DLLM_UNMASKED) & (state == DLLM_MASKED)).sum() > 1)
            ids = torch.where(state_after == DLLM_MASKED, torch.tensor(mask_id), tokens)  # sequence.py: masks stay
            state = state_after
            count += 1
        steps.append(count)
        output += ids.tolist()[tail:]
        seq = seq[:start] + ids.tolist()
        start += block_size
    return {"tokens": output[:max_new_tokens], "steps": steps, "parallel_steps": parallel}


# --- LMDeploy's released module --------------------------------------------------------------------------------------
def lmdeploy_source_dir() -> pathlib.Path:
    """A folder holding the ``lmdeploy/`` package of the released wheel (its Python files).

    ``$HF_BDLM_LMDEPLOY_SOURCE`` if set (e.g. an unzipped wheel); else fetched once with ``pip download --no-deps
    lmdeploy==0.18.0`` into hf_bdlm's cache (``engine_sources/``; the wheel is not installed: it pins another torch).

    Raises:
        RuntimeError: the wheel could not be fetched (no package index).
    """
    import shutil
    import tempfile
    import zipfile

    from hf_bdlm.cache import cache_home, install_dir

    given = os.environ.get("HF_BDLM_LMDEPLOY_SOURCE")
    if given:
        return pathlib.Path(given)

    def complete(path: pathlib.Path) -> bool:
        return (path / "lmdeploy" / "pytorch" / "strategies" / "dllm" / "unmasking.py").is_file()

    def build(tmp: pathlib.Path) -> None:
        download = pathlib.Path(tempfile.mkdtemp())
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d",
                                   str(download), f"lmdeploy=={LMDEPLOY_VERSION}"], capture_output=True, text=True)
            wheels = list(download.glob("lmdeploy-*.whl"))
            if done.returncode or not wheels:
                raise RuntimeError(f"pip download lmdeploy=={LMDEPLOY_VERSION} failed: {done.stderr.strip()[-400:]}")
            with zipfile.ZipFile(wheels[0]) as wheel:
                for name in wheel.namelist():
                    if name.startswith("lmdeploy/") and name.endswith(".py"):
                        wheel.extract(name, tmp)
        finally:
            shutil.rmtree(download, ignore_errors=True)

    path = cache_home() / "engine_sources" / f"lmdeploy-{LMDEPLOY_VERSION}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return install_dir(path, build, complete)[0]


def lmdeploy_unmasking_module(source: pathlib.Path | None = None):
    """LMDeploy's `lmdeploy.pytorch.strategies.dllm.unmasking`, imported from the released wheel's files.

    The package's ``__init__`` files of ``lmdeploy`` and ``lmdeploy.pytorch`` import the whole engine (mmengine,
    zmq, ...); the unmasking module needs only ``torch`` and two small modules of its own, so those two packages are
    entered by their path without running their ``__init__``."""
    import importlib

    source = pathlib.Path(source or lmdeploy_source_dir())
    for name, sub in (("lmdeploy", "lmdeploy"), ("lmdeploy.pytorch", "lmdeploy/pytorch")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(source / sub)]
            sys.modules[name] = package
    return importlib.import_module("lmdeploy.pytorch.strategies.dllm.unmasking")


# --- the table -------------------------------------------------------------------------------------------------------
def equivalence_table(model, tokenizer, folder, *, prompt_lengths, thresholds, new_tokens: int,
                      lmdeploy_module=None) -> list[dict]:
    """For every (rule, prompt length, threshold): ``model.generate(..., unmasking=rule)`` against the engine's
    algorithm on the exported weights (``folder``); rows say whether the tokens are identical."""
    B = model.config.block_size
    mask = model.config.mask_token_id
    qwen3 = load_reference_qwen3(folder)
    forward = block_forward(qwen3, B)
    torch.manual_seed(1)
    base = torch.randint(0, 151000, (max(prompt_lengths),)).tolist()
    rows = []
    for length in prompt_lengths:
        prompt = base[:length]
        for threshold in thresholds:
            cases = {
                "sglang_low_confidence": lambda: sglang_low_confidence(forward, prompt, B, threshold, new_tokens, mask),
                "lmdeploy_low_confidence_dynamic": lambda: lmdeploy_decode(
                    forward, prompt, B, new_tokens, mask, lmdeploy_dynamic_transcribed(B, threshold)),
            }
            if lmdeploy_module is not None:
                cases["lmdeploy UnmaskingProcessor (released)"] = lambda: lmdeploy_decode(
                    forward, prompt, B, new_tokens, mask, lmdeploy_dynamic_released(lmdeploy_module, B, threshold))
            for name, run in cases.items():
                rule = "lmdeploy_low_confidence_dynamic" if name.startswith("lmdeploy") else name
                ours = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, unmasking=rule,
                                      confidence_threshold=threshold, eos_token_id=None)[0, length:].tolist()
                engine = run()
                rows.append({"rule": name, "prompt_length": length, "prompt_length_mod_block": length % B,
                             "threshold": threshold, "new_tokens": new_tokens, "identical": ours == engine["tokens"],
                             "engine_steps_per_block": engine["steps"],
                             "steps_fixing_several_positions": engine["parallel_steps"],
                             "mask_tokens_in_output": sum(t == mask for t in engine["tokens"])})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=None, help="write equivalence.json and equivalence.md here")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[3, 8, 10])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.6, 0.9, 0.95])
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    import tempfile

    torch.set_num_threads(1)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from tiny_qwen3 import qwen3_layout_tokenizer, sharpen_head, tiny_qwen3

    from hf_bdlm import convert_causal_lm
    from hf_bdlm.models.block_diffusion.inference.export_sdar import export_sdar, zero_mask_logit

    try:
        module = lmdeploy_unmasking_module()
    except RuntimeError as err:
        print(f"LMDeploy's own UnmaskingProcessor not compared: {err}")
        module = None
    torch.manual_seed(3)
    prefix, block = torch.randint(0, 151000, (8,)).tolist(), [17, 151669, 5, 151669]
    logits = []
    with tempfile.TemporaryDirectory() as tmp:
        for tie in (False, True):
            model, tokenizer = convert_causal_lm(tiny_qwen3(tie=tie), qwen3_layout_tokenizer(), block_size=4,
                                                 objective="standard")
            for mode in ("keep", "zero"):
                folder = export_sdar(model.eval(), pathlib.Path(tmp) / f"{tie}-{mode}", tokenizer, mask_logit=mode)
                logits.append({"tied": tie, "mask_logit": mode, **logits_difference(model, folder, prefix, block)})
        lm = tiny_qwen3(tie=False)
        sharpen_head(lm)
        model, tokenizer = convert_causal_lm(lm, qwen3_layout_tokenizer(), block_size=4, objective="standard")
        model = zero_mask_logit(model.eval())  # what the export serves: the [MASK] logit 0
        folder = export_sdar(model, pathlib.Path(tmp) / "sdar", tokenizer)
        logits.append({"tied": False, "mask_logit": "zero", "head": "x100",
                       **logits_difference(model, folder, prefix, block)})
        rows = equivalence_table(model, tokenizer, folder, prompt_lengths=args.prompt_lengths,
                                 thresholds=args.thresholds, new_tokens=args.new_tokens, lmdeploy_module=module)
    logit_lines = ["| head | `mask_logit` | max abs difference (every other column) | largest logit | export's [MASK] "
                   "logit, max abs |", "|---|---|---|---|---|"]
    for entry in logits:
        head = ("tied" if entry["tied"] else "untied") + (", x100" if "head" in entry else "")
        logit_lines.append(f"| {head} | {entry['mask_logit']} | {entry['max_abs_difference']:.3g} | "
                           f"{entry['max_abs_logit']:.3g} | {entry['export_mask_logit_max_abs']:.3g} |")
    print("\n".join(logit_lines))
    header = "| rule | prompt length (mod 4) | threshold | identical | engine steps per block | steps fixing >1 |"
    lines = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rule']} | {r['prompt_length']} ({r['prompt_length_mod_block']}) | {r['threshold']} | "
                     f"{'yes' if r['identical'] else '**no**'} | {r['engine_steps_per_block']} | "
                     f"{r['steps_fixing_several_positions']} |")
    table = "\n".join(lines)
    print(table)
    print(f"identical: {sum(r['identical'] for r in rows)}/{len(rows)}")
    if args.out_dir:
        out = pathlib.Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        setting = {"model": "tiny Qwen3 (2 layers, hidden 32, vocab 151936, head x100, untied), converted with "
                            "objective='standard', block 4, [MASK] row of the head zero (the export's)",
                   "lmdeploy_released_processor": module is not None, "dtype": "float32",
                   "torch": torch.__version__}
        (out / "equivalence.json").write_text(json.dumps({"setting": setting, "logits": logits, "rows": rows},
                                                         indent=2) + "\n")
        (out / "equivalence.md").write_text(
            "SDAR export, checked on CPU (`python scripts/sdar_engines.py`; float32, torch " + torch.__version__
            + "). Model: a tiny Qwen3 with Qwen3's vocabulary (151936 rows) converted with objective='standard', "
            "block 4.\n\nLogits: our model at inference (clean prefix of 8 tokens, noisy block of 4 over the cached "
            "prefix) against the exported weights loaded strictly into transformers' Qwen3ForCausalLM under the "
            "engines' block-causal mask.\n\n" + "\n".join(logit_lines) + "\n\nDecoder equivalence: "
            "`generate(unmasking=RULE)` against each engine's algorithm driving the exported weights (head x100, "
            "untied, [MASK] row zero as exported), 16 new tokens; 'engine steps per block' are the denoising steps "
            "of each block.\n\n" + table + "\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
