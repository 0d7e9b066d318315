"""lm-eval's ``--model bdlm``: any checkpoint hf_bdlm trains, scored by EleutherAI's lm-evaluation-harness.

lm-eval finds models by name in its registry, filled when ``lm_eval.models`` is imported; it has no plug-in hook, so
this module registers ``bdlm`` when it is imported, and ``hf-bdlm lm-eval ...`` imports it and runs lm-eval's own
command line with the same arguments::

    hf-bdlm lm-eval --model bdlm --model_args pretrained=outputs/smollm2-135m-bdlm-csbp,mc_num=32 \\
        --tasks arc_easy,gsm8k --batch_size 8 --output_path out/lm_eval

    import lm_eval, hf_bdlm.evaluation.lm_eval_model            # registers "bdlm"
    lm_eval.simple_evaluate(model="bdlm", model_args="pretrained=DIR", tasks=["arc_easy"])
    lm_eval.simple_evaluate(model=HFBDLMEvalModel(pretrained="DIR", batch_size=8), tasks=["arc_easy"])

The checkpoint's family (``hf_bdlm.models``, from its config) loads it and does the work, so every family hf_bdlm
trains is scored the way it decodes:

- ``generate_until``: the family's own decoding (what ``hf-bdlm serve`` runs), its settings as model args
  (``block_size``, ``confidence_threshold``, ``steps_per_block``, ``seed``) or per task in ``gen_kwargs``; it stops
  at ``until`` (the text is cut before the first one) and after ``max_gen_toks`` tokens.
- ``loglikelihood`` / ``loglikelihood_rolling``: the family's likelihood bound, a Monte-Carlo estimate with
  ``mc_num`` samples (the family's evaluation role, ``EvaluationSpec.likelihood_scorer``); the standard errors are logged, and kept per request in
  ``last_stderrs``. ``is_greedy``: one parallel denoising step from the prior predicts the whole continuation.

**Batch invariance.** Every random draw is a function of ``(seed, request tokens, sample, position)``, and requests
share a forward pass only with requests of the same block geometry, so no row is padded: scores and generations are
the same at every ``batch_size`` (exactly, where the hardware computes a row independently of its batch's size, as
the CPU kernels do; ``tests/evaluation/test_lm_eval.py`` checks 1 against 8).

**Progress.** Each request type shows a bar over its requests, moved once per forward batch (:mod:`hf_bdlm.progress`:
standard error, rank 0, a terminal; lm-eval's ``disable_tqdm`` turns it off).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models first: it fills its registry only while it is empty)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from transformers import AutoConfig

from ..embedded import default_model_dir
from ..objectives.likelihood import request_key
from ..progress import progress_bar
from ..protocols.decoding import DecodingRequest
from ..protocols.likelihood import ScoreRequest
from ..protocols.registry import family_for_config, family_for_model
from ..serving.scheduler import TextStream

logger = logging.getLogger(__name__)

DEFAULT_MC_NUM = 32
DEFAULT_MAX_GEN_TOKS = 256
# gen_kwargs a task may set, besides `until` and `max_gen_toks`; anything else is refused by name.
DECODING_KWARGS = ("do_sample", "temperature", "top_p", "confidence_threshold", "steps_per_block", "block_size")


@register_model("bdlm")
class HFBDLMEvalModel(TemplateLM):
    """A model of any hf_bdlm family as an lm-eval ``LM`` (module docstring).

    Parameters:
        pretrained (`str`): a checkpoint folder of a family hf_bdlm trains, a causal-LM folder (converted on the fly,
            untrained, block size ``conversion_block_size``) or ``embedded:smollm2``. Or pass ``model`` (and
            ``tokenizer``): a model object of a registered family.
        dtype (`str`, *optional*): ``float32``, ``bfloat16``, ``float16`` or ``float64`` (default: the checkpoint's).
        device (`str`, *optional*): e.g. ``cuda``, ``cpu``.
        batch_size (`int`, defaults to 1): requests per forward pass.
        mc_num (`int`, defaults to 32): Monte-Carlo samples per likelihood request.
        seed (`int`, defaults to 0): seed of the likelihood noise and of sampled decoding (a rerun gives the same
            numbers).
        block_size, confidence_threshold, steps_per_block: decoding settings (default: the checkpoint's generation
            config); ``steps`` is an alias of ``steps_per_block``.
        max_gen_toks (`int`, defaults to 256): completion budget when a task sets none.
        max_length (`int`, *optional*): context of the rolling log-likelihood windows and the longest prompt plus
            completion (default: the model's context).
        add_bos_token (`bool`, defaults to False): let the tokenizer add its special tokens to every context.
    """

    def __init__(self, pretrained: str | None = None, *, model=None, tokenizer=None, dtype: str | None = None,
                 device: str | None = None, batch_size: int | str | None = 1, max_batch_size: int | None = None,
                 mc_num: int = DEFAULT_MC_NUM, seed: int = 0, block_size: int | None = None,
                 confidence_threshold: float | None = None, steps_per_block: int | None = None,
                 steps: int | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, max_length: int | None = None,
                 add_bos_token: bool = False, conversion_block_size: int = 32, **unknown: Any):
        super().__init__()
        if unknown:
            raise TypeError(f"--model bdlm got unknown model_args {sorted(unknown)}; it takes pretrained, dtype, device, "
                            "batch_size, mc_num, seed, block_size, confidence_threshold, steps_per_block (steps), "
                            "max_gen_toks, max_length, add_bos_token, conversion_block_size.")
        if model is None:
            if pretrained is None:
                raise ValueError("--model bdlm needs model_args pretrained=DIR (a checkpoint folder, a causal-LM "
                                 "folder or embedded:smollm2), or a model object.")
            model, tokenizer = load_for_evaluation(str(pretrained), dtype, device, int(conversion_block_size))
        elif tokenizer is None:
            raise ValueError("a model object needs its tokenizer: HFBDLMEvalModel(model=m, tokenizer=t).")
        family = family_for_model(model)
        if family is None:
            raise TypeError(f"{type(model).__name__} is not a model of a family hf_bdlm trains "
                            "(hf_bdlm.models.family_names()).")
        self.family, self.tokenizer = family, tokenizer
        self.decoder = family.role("serving").decoder(model, tokenizer)
        self.model = self.decoder.model
        self._scorer = None
        self.batch_size = _positive_int("batch_size", 1 if batch_size is None else batch_size)
        self.mc_num = _positive_int("mc_num", mc_num)
        self.seed = int(seed)
        if steps is not None and steps_per_block is not None and int(steps) != int(steps_per_block):
            raise ValueError(f"steps={steps} and steps_per_block={steps_per_block} disagree; pass one of them.")
        steps_per_block = steps_per_block if steps_per_block is not None else steps
        self.decoding = DecodingRequest(
            temperature=0.0, block_size=None if block_size is None else _positive_int("block_size", block_size),
            confidence_threshold=None if confidence_threshold is None else float(confidence_threshold),
            steps_per_block=None if steps_per_block is None else _positive_int("steps_per_block", steps_per_block))
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self._max_length = self.decoder.context_length if max_length is None else _positive_int("max_length",
                                                                                                max_length)
        self.add_bos_token = bool(add_bos_token)
        self.last_stderrs: list[float] = []
        self._check_decoding(self.decoding)

    # --- what TemplateLM asks ----------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return list(self.tokenizer(string, add_special_tokens=special)["input_ids"])

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # --- likelihood ----------------------------------------------------------------------------------------------
    @property
    def scorer(self):
        """The family's likelihood scorer (built on first use: a family without a likelihood raises then)."""
        if self._scorer is None:
            self._scorer = self.family.role("evaluation").likelihood_scorer(self.model, self.tokenizer)
        return self._scorer

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        scores = self._score([ScoreRequest(tuple(context), tuple(continuation))
                              for _, context, continuation in requests], "loglikelihood", disable_tqdm)
        results = []
        for (cache_key, _, _), estimate in zip(requests, scores):
            answer = (estimate.log_likelihood, estimate.greedy)
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            # A window's max_seq_len predicted tokens plus the one before them fill max_length.
            for window in get_rolling_token_windows(token_list=tokens, prefix_token=self.prefix_token_id,
                                                    max_seq_len=self.max_length - 1, context_len=1):
                context, continuation = make_disjoint_window(window)
                windows.append(ScoreRequest(tuple(context), tuple(continuation)))
                owner.append(i)
        scores = self._score(windows, "loglikelihood_rolling (windows)", disable_tqdm)
        totals, variances = [0.0] * len(requests), [0.0] * len(requests)
        for i, estimate in zip(owner, scores):
            totals[i] += estimate.log_likelihood
            variances[i] += estimate.stderr ** 2  # windows draw independent noise (their tokens differ)
        self.last_stderrs = [math.sqrt(v) for v in variances]
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _score(self, requests: list[ScoreRequest], desc: str = "loglikelihood", disable_tqdm: bool = False):
        for r in requests:
            if not r.context:
                raise ValueError("a likelihood request has no context token; the tokenizer has no BOS or EOS to put "
                                 "before an empty context (pass a tokenizer that defines one).")
            if len(r.context) + len(r.continuation) > self.max_length:
                raise ValueError(f"a likelihood request of {len(r.context) + len(r.continuation)} tokens exceeds "
                                 f"max_length={self.max_length}; shorten the task's contexts (fewer few-shot "
                                 "examples) or raise max_length up to the model's context.")
        with self._bar(len(requests), desc, disable_tqdm) as bar:
            scores = self.scorer.score(requests, mc_num=self.mc_num, seed=self.seed, batch_size=self.batch_size,
                                       on_batch=bar.update)
        self.last_stderrs = [s.stderr for s in scores]
        finite = [s for s in self.last_stderrs if not math.isnan(s)]
        if finite:
            logger.info("%d likelihood requests: %s, mc_num=%d, seed=%d; standard error per request: mean %.4g, "
                        "max %.4g", len(requests), self.scorer.bound, self.mc_num, self.seed,
                        sum(finite) / len(finite), max(finite))
        return scores

    # --- generation ----------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs = []
        for request in requests:
            context, gen_kwargs = request.args
            prompt = self.tok_encode(context)
            decoding, until, max_tokens = self._generation_settings(gen_kwargs)
            if not prompt:
                raise ValueError("a generation request has an empty context; add_bos_token=True gives it the "
                                 "tokenizer's special tokens.")
            if len(prompt) + max_tokens > self.max_length:
                raise ValueError(f"a generation request of {len(prompt)} prompt tokens plus max_gen_toks={max_tokens} "
                                 f"exceeds max_length={self.max_length}; lower max_gen_toks or shorten the context.")
            seed = request_key((self.seed,), prompt) & ((1 << 63) - 1)
            settings = self.decoder.settings(replace(decoding, seed=seed), len(prompt), max_tokens)
            group = (self.decoder.batch_key(settings, seed), self.decoder.padding_free_key(len(prompt), settings))
            jobs.append((group, prompt, settings, seed, TextStream(self.tokenizer, until)))
        groups: dict[Any, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(job[0], []).append(i)
        with self._bar(len(jobs), "generate_until", disable_tqdm) as bar:
            for members in groups.values():
                for start in range(0, len(members), self.batch_size):
                    batch = members[start : start + self.batch_size]
                    self._decode([jobs[i] for i in batch])
                    bar.update(len(batch))
        texts = []
        for request, job in zip(requests, jobs):
            text = job[4].text
            self.cache_hook.add_partial("generate_until", request.args, text)
            texts.append(text)
        return texts

    def _decode(self, jobs) -> None:
        eos = [self.decoder.eos_token_ids(settings) for _, _, settings, _, _ in jobs]

        def on_block(new: dict) -> set[int]:
            stop = set()
            for row, tokens in new.items():
                ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
                _, stopped = jobs[row][4].add(ids)
                if stopped or (ids and ids[-1] in eos[row]):
                    stop.add(row)
            return stop

        with torch.no_grad():
            self.decoder.decode([job[1] for job in jobs], [job[2] for job in jobs], [job[3] for job in jobs],
                                on_block)

    def _bar(self, total: int, desc: str, disable_tqdm: bool):
        """A bar over ``total`` requests (off with lm-eval's ``disable_tqdm``, and off rank 0 of lm-eval's world)."""
        return progress_bar(total=total, desc=f"bdlm {desc}", unit="request",
                            enabled=not disable_tqdm and self.rank == 0)

    def _generation_settings(self, gen_kwargs: dict) -> tuple[DecodingRequest, list[str], int]:
        kwargs = dict(gen_kwargs or {})
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_tokens = _positive_int("max_gen_toks", kwargs.pop("max_gen_toks", self.max_gen_toks))
        unknown = sorted(set(kwargs) - set(DECODING_KWARGS))
        if unknown:
            raise ValueError(f"--model bdlm cannot honour the task's gen_kwargs {unknown}; it takes until, max_gen_toks "
                             f"and {', '.join(DECODING_KWARGS)}.")
        do_sample = kwargs.pop("do_sample", None)
        temperature = kwargs.pop("temperature", None)
        if do_sample is False or (do_sample is None and not temperature):
            temperature = 0.0
        elif temperature is None or temperature == 0:
            temperature = 1.0  # do_sample=True without a temperature: transformers' default
        fields = {"temperature": float(temperature)}
        for name in ("top_p", "confidence_threshold", "steps_per_block", "block_size"):
            if kwargs.get(name) is not None:
                fields[name] = kwargs[name]
        decoding = replace(self.decoding, **fields)
        self._check_decoding(decoding)
        return decoding, until, max_tokens

    def _check_decoding(self, decoding: DecodingRequest) -> None:
        """Ask the family's decoder for settings once, so that a value it refuses fails before any request runs."""
        self.decoder.settings(decoding, 1, 1)


def load_for_evaluation(path: str, dtype: str | None, device: str | None, conversion_block_size: int):
    """``(model, tokenizer)`` of a checkpoint folder, loaded by its family's evaluation role (``EvaluationSpec.load``)."""
    if path == "embedded:smollm2":
        path = str(default_model_dir())
    if not Path(path).is_dir():
        raise FileNotFoundError(f"pretrained={path!r} is not a folder; pass a checkpoint folder (or embedded:smollm2).")
    kwargs = {}
    if dtype not in (None, "auto"):
        if dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"dtype={dtype!r}; pass float32, bfloat16, float16 or float64.")
        kwargs["dtype"] = getattr(torch, dtype)
    if device in ("cuda", "cuda:0") and not torch.cuda.is_available():
        # lm-eval's command line passes cuda:0 whenever --device is not given (its HF model type does the same).
        logger.warning("device %s is not available here (lm-eval's default); evaluating on the CPU", device)
        device = "cpu"
    config = AutoConfig.from_pretrained(path)
    model, tokenizer = family_for_config(config).role("evaluation", path).load(path, config, kwargs,
                                                                             conversion_block_size)
    if device:
        model = model.to(device)
    return model.eval(), tokenizer


def _positive_int(name: str, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive integer, got {value!r}.") from None
    if number < 1 or number != float(value):
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return number
