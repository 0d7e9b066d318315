"""CI: the folder the quickstart saved loads the way a user loads it and generates.

    python .ci/check_saved_model.py OUTPUT_DIR

Fresh process, `AutoModel.from_pretrained` (with hf_bdlm imported, as the quickstart's snippet says), one held-out
prompt answered by block-wise generation; fails unless the answer is non-empty text and the recipe's own reload check
recorded in sft_results.json gave the same answer.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

import hf_bdlm
from hf_bdlm.data import load_arith

torch.set_num_threads(1)  # as in the recipe's processes (torchrun sets OMP_NUM_THREADS=1): the same reductions
out = Path(sys.argv[1])
model = AutoModel.from_pretrained(out)
tokenizer = AutoTokenizer.from_pretrained(out)
assert isinstance(model, hf_bdlm.BlockDiffusionForMaskedLM), type(model)
example = load_arith("test")[0]
ids = tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True, return_tensors="pt",
                                    return_dict=True)["input_ids"]
with torch.no_grad():
    generated = model.generate(ids, max_new_tokens=model.config.block_size)
text = tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)
recorded = json.loads((out / "sft_results.json").read_text())["reload_check"]
print(f"reloaded {type(model).__name__} from {out}: {example['prompt'][-1]['content']!r} -> {text!r} "
      f"(expected {example['answer']!r}; the recipe's reload check got {recorded['got']!r})")
assert generated.shape[1] > ids.shape[1] and text.strip(), "the reloaded model generated nothing"
assert text == recorded["got"], "a fresh process generated another answer than the recipe's reload check"
