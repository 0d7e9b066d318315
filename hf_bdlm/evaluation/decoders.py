"""What decodes a model for an evaluation or a benchmark, and the meter that counts its forwards.

- :class:`GreedyAR`: greedy ``generate`` of a causal LM (left-padded batches), the AR baseline;
- :func:`serve_decode`: decoding through a family's serving decoder (what ``hf-bdlm serve`` runs: a model of any
  family with a serving role, or a causal LM with a drafter);
- :class:`ForwardMeter`: counts and times the forward calls of a decoder's ``counted_modules()`` (the ``"model"``
  entry: the forwards that produce tokens, the prompt's forward included), so that tokens per forward mean the same
  for every decoder.

Both decoders take ``stop(row, tokens) -> bool``, called each time a row's tokens grow (after every block of a serving
decoder, every step of AR) with all of the row's tokens so far: a true answer ends the row there (a stop sequence, as
a server's ``stop`` does). Used by the decoding study (:mod:`hf_bdlm.benchmarks.decoding_study`) and HumanEval
(:mod:`hf_bdlm.evaluation.humaneval`).
"""

from __future__ import annotations

import time
from typing import Callable

from ..protocols.decoding import DecodingRequest

Stop = Callable[[int, list], bool]


# --- counting forwards ------------------------------------------------------------------------------------------------
def rows_of(args, kwargs) -> int:
    """Rows a module's forward runs: ``[b, n]`` ids (an encoder-decoder's decoder: its ``decoder_input_ids``), or
    ``[..., d]`` states (every dimension but the last)."""
    for name in ("inputs_embeds", "input_ids", "decoder_input_ids", "hidden_states"):
        if kwargs.get(name) is not None:
            tensor = kwargs[name]
            break
    else:
        tensor = next((a for a in args if hasattr(a, "shape")), None)
    if tensor is None:
        return 0
    if tensor.is_floating_point():
        return int(tensor.numel() // max(tensor.shape[-1], 1))
    return int(tensor.numel())


class ForwardMeter:
    """Counts and times the forwards of a decoder's ``counted_modules()`` (calls, rows, CPU and wall seconds of
    each), while it is entered: ``forwards[name]`` lists ``(rows, cpu_seconds, wall_seconds)`` per call."""

    def __init__(self, modules: dict):
        self.modules = modules
        self.forwards: dict[str, list[tuple[int, float, float]]] = {name: [] for name in modules}
        self.handles, self.open = [], {}

    def __enter__(self):
        for name, module in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        return self

    def _pre(self, name):
        def hook(module, args, kwargs):
            self.open[name] = (rows_of(args, kwargs), time.process_time(), time.perf_counter())
        return hook

    def _post(self, name):
        def hook(module, args, kwargs, output):
            rows, cpu, wall = self.open.pop(name)
            self.forwards[name].append((rows, time.process_time() - cpu, time.perf_counter() - wall))
        return hook

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def count(self, name: str = "model") -> int:
        """Forward calls of ``name`` counted so far."""
        return len(self.forwards[name])


# --- the decoders -----------------------------------------------------------------------------------------------------
class GreedyAR:
    """Greedy ``generate`` of a causal LM (left-padded batches), the baseline every speed is compared with."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model.eval(), tokenizer
        eos = model.generation_config.eos_token_id
        self.eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos, default=0)
        self.pad = int(pad)

    @property
    def context_length(self) -> int | None:
        """Most tokens (prompt + completion) the model takes, from its config (``None`` when it names none)."""
        return getattr(self.model.config, "max_position_embeddings", None)

    def counted_modules(self) -> dict:
        return {"model": self.model.get_decoder(), "head": self.model.get_output_embeddings()}

    def decode(self, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool,
               stop: Stop | None = None) -> list[list[int]]:
        import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=self.pad)
        if ignore_eos:
            kwargs.update(eos_token_id=None, min_new_tokens=max_new_tokens)
        ends: list[int | None] = [None] * len(prompts)  # where ``stop`` ended a row (its length then)
        if stop is not None:
            kwargs["stopping_criteria"] = row_stop_criteria(stop, width, ends, set() if ignore_eos else self.eos)
        device = self.model.device
        out = self.model.generate(ids.to(device), attention_mask=mask.to(device), **kwargs)
        rows = [row[width:].tolist() for row in out]
        return [cut_at_eos(row if end is None else row[:end], self.eos) for row, end in zip(rows, ends)]


def row_stop_criteria(stop: Stop, width: int, ends: list, eos: set[int]):
    """transformers' stopping criteria (a list of one) asking ``stop`` about every row still decoding after each
    step, and ending the rows it answers true for (their lengths written into ``ends``)."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from transformers import StoppingCriteria, StoppingCriteriaList

    class RowStop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            for row, tokens in enumerate(input_ids[:, width:].tolist()):
                if ends[row] is not None:
                    done[row] = True
                    continue
                if any(t in eos for t in tokens[:-1]):  # ended at EOS before this step: generate pads it
                    continue
                if stop(row, tokens):
                    ends[row] = len(tokens)
                    done[row] = True
            return done

    return StoppingCriteriaList([RowStop()])


def cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for at, token in enumerate(tokens):
        if token in eos:
            return tokens[: at + 1]
    return tokens


def serve_decode(decoder, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool,
                 eos: set[int], stop: Stop | None = None) -> list[list[int]]:
    """Decode through a family's serving decoder (what ``hf-bdlm serve`` runs); a decoder told to ignore EOS decodes
    the whole budget and its text is cut at the first EOS after. ``stop``: as the module says (a row it ends keeps
    the whole block that ended it)."""
    request = DecodingRequest(ignore_eos=ignore_eos, seed=0)
    settings = [decoder.settings(request, len(p), max_new_tokens) for p in prompts]
    got: list[list[int]] = [[] for _ in prompts]

    def on_block(new):
        ended = set()
        for row, tokens in new.items():
            tokens = [int(t) for t in tokens]
            if not tokens:
                continue
            got[row] += tokens
            if stop is not None and stop(row, got[row]):
                ended.add(row)
        return ended

    decoder.decode(prompts, settings, [0] * len(prompts), on_block)
    return [cut_at_eos(tokens, eos) for tokens in got]


__all__ = ["ForwardMeter", "GreedyAR", "cut_at_eos", "rows_of", "serve_decode"]
