"""The tests' tiny models, tokenizers and servers: one definition of each, parameterized where the tests differ.

- :func:`word_tokenizer`: a word-level tokenizer over a list of words (tests/tiny_bdlm.py,
  tests/distributed/trainer_common.py and tests/distributed/tiny_diffusion_gemma.py give theirs, with their special
  tokens and chat templates; the hub and conversion tests theirs).
- :func:`tiny_target`: a tiny random causal LM (Llama, Qwen3 or Gemma 3): a DFlash drafter's target, a speculative
  server's target, a causal LM to convert. :func:`tiny_drafter`: a DFlash2 / DFlash drafter for it. A test module
  that builds many binds its sizes once (``functools.partial``).
- :func:`families_with_role` and :func:`for_family`: the registered families a test runs over, read from the registry
  (a new family needs no test edit), and a test's per-family table that fails naming a family it lacks.
- :func:`serve`, :func:`openai_client` and the module-scoped pytest fixtures ``engine``, ``server`` and ``client``
  (tests/serving/conftest.py hands them to the serving tests): a module gives its checkpoint through a ``served``
  fixture (the arguments of ``Engine.from_pretrained``), its server settings as ``SERVER`` (``ServerConfig`` fields)
  and its client's timeout as ``CLIENT_TIMEOUT``.

A top-level module for the tests (tests/conftest.py puts tests/ on ``sys.path``) and for the torchrun workers of
tests/distributed/ (every launch puts tests/ on their ``PYTHONPATH``: :data:`paths.PYTHONPATH`).
"""

from __future__ import annotations

import pytest
import torch

API_KEY = "test-key"  # the servers' API key

# --- the registered families ---------------------------------------------------------------------------------------


def families_with_role(kind: str) -> list[str]:
    """The registered families (registry order) that play the role ``kind`` (``"serving"``, ``"evaluation"``, ...):
    what a test parametrizes over instead of a list of names."""
    from hf_bdlm.protocols.registry import family_named, family_names

    return [name for name in family_names() if family_named(name).has_role(kind)]


def for_family(table: dict, family: str):
    """``table[family]``: a test's tiny model (or fixture) of a registered family; a registered family the table lacks
    fails the test naming it, so that a new family gets its tiny model here rather than going untested."""
    if family not in table:
        pytest.fail(f"the registered family {family!r} has no entry in this test's table (it has {sorted(table)}): "
                    "add a tiny model of it", pytrace=False)
    return table[family]


# --- tokenizers ------------------------------------------------------------------------------------------------------


def word_tokenizer(words: list[str], chat_template: str | None = None, **special_tokens):
    """A `PreTrainedTokenizerFast` whose ids are the positions of ``words``: the text splits on whitespace and
    punctuation, an unknown word is ``[UNK]`` (which ``words`` must hold).

    Args:
        words: the vocabulary, special tokens included, in id order.
        chat_template: set as the tokenizer's chat template.
        special_tokens: `PreTrainedTokenizerFast`'s special-token arguments (``pad_token``, ``bos_token``,
            ``eos_token``, ``mask_token``, ``additional_special_tokens``).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", **special_tokens)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


# --- a target and its drafter ----------------------------------------------------------------------------------------

# The target's config fields unless a test gives others: vocabulary 64, width 32, 3 layers of 4 heads (2 K/V heads).
TARGET_FIELDS = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=64)
TARGET_KINDS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def tiny_target(kind: str = "llama", *, seed: int = 0, dtype: torch.dtype | None = None, head_std: float | None = None,
                frozen: bool = False, training: bool = False, **fields):
    """A tiny random causal LM, in eval mode.

    Args:
        kind: ``"llama"``, ``"qwen3"`` or ``"gemma3"`` (Qwen3 and Gemma 3 with heads of 8 unless ``head_dim`` says).
        seed: the weights are those of ``torch.manual_seed(seed)``.
        dtype: cast to it (default: float32).
        head_std: the LM head redrawn from N(0, head_std^2), in ``dtype``, after construction (a head that separates
            tokens: the default initializer_range 0.02 leaves every softmax nearly flat).
        frozen: ``requires_grad`` off.
        training: left in training mode.
        fields: config fields over :data:`TARGET_FIELDS` (``num_hidden_layers``, ``pad_token_id``, ...).
    """
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in TARGET_KINDS[kind])
    values = {**TARGET_FIELDS, **fields}
    if kind != "llama":
        values.setdefault("head_dim", 8)
    torch.manual_seed(seed)
    model = model_class(config_class(**values))
    if not training:
        model.eval()
    if frozen:
        model.requires_grad_(False)
    if dtype is not None:
        model = model.to(dtype)
    if head_std is not None:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, head_std)
    return model


def tiny_drafter(target, dflash2: bool = True, *, seed: int = 1, noise: str | None = None, training: bool = True,
                 dflash2_fields: dict | None = None, **fields):
    """A DFlash2 drafter (``dflash2=False``: a DFlash one) for ``target``, bound to it, in its dtype and on its device.

    Args:
        target: the causal LM it drafts for (its config gives the vocabulary and width).
        dflash2: a DFlash2 drafter (convolutions, candidate selector), else a DFlash one.
        seed: the weights' seed, as ``noise`` says.
        noise: ``None``: transformers-style initialisation (identity convolutions, a zero codebook) under
            ``torch.manual_seed(seed)``; ``"normal"``: every weight redrawn from N(0, 1) after
            ``torch.manual_seed(seed)`` (an identity or a zero would hide a swapped tensor); ``"around_one"``: norms
            1 + 0.2 N(0, 1) and every other weight 0.3 N(0, 1), drawn in float64 from a generator of ``seed`` into the
            float32 weights before the cast to the target's dtype (the global generator is left to the construction).
        training: left in training mode (the construction's), else in eval mode.
        dflash2_fields: config fields a DFlash2 drafter takes and a DFlash one has not (``selector_rank``, ...),
            dropped for a DFlash drafter.
        fields: the fields of ``DFlashConfig.for_target`` (``num_hidden_layers``, ``block_size``, ``mask_token_id``,
            ``target_layer_ids``, ...); they win over ``dflash2_fields``.
    """
    from hf_bdlm.models.dflash.configuration import DFlashConfig
    from hf_bdlm.models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel

    if noise not in (None, "normal", "around_one"):
        raise ValueError(f"noise must be None, 'normal' or 'around_one', got {noise!r}")
    if dflash2:
        fields = {**(dflash2_fields or {}), **fields}
    if noise is None:
        torch.manual_seed(seed)
    config = DFlashConfig.for_target(target.config, dflash2=dflash2, **fields)
    model = (DFlash2DraftModel if dflash2 else DFlashDraftModel)(config)
    with torch.no_grad():
        if noise == "normal":
            torch.manual_seed(seed)
            for parameter in model.parameters():
                parameter.normal_()
        elif noise == "around_one":
            generator = torch.Generator().manual_seed(seed)
            for name, parameter in model.named_parameters():
                draw = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                parameter.copy_(1.0 + 0.2 * draw if name.endswith("norm.weight") else 0.3 * draw)
    reference = next(target.parameters())
    model = model.to(device=reference.device, dtype=reference.dtype).bind_target(target)
    return model if training else model.eval()


# --- servers ---------------------------------------------------------------------------------------------------------


def serve(engine, **config):
    """A `ServerThread` (a context manager) serving ``engine`` on a free port of 127.0.0.1 with :data:`API_KEY`;
    ``config``: `ServerConfig` fields."""
    from hf_bdlm.serving import ServerConfig, ServerThread

    return ServerThread(engine, ServerConfig(**{"port": 0, "api_key": API_KEY, **config}))


def openai_client(server, api_key: str = API_KEY, timeout: float = 60):
    """The official `openai` client of ``server`` (no retries: a refusal shows as it is)."""
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def engine(served):
    """The module's engine: ``Engine.from_pretrained(**served)`` (``served``: the module's fixture naming the
    checkpoint folder, ``path``, and the engine's options)."""
    from hf_bdlm.serving import Engine

    return Engine.from_pretrained(**served)


@pytest.fixture(scope="module")
def server(request, engine):
    """The module's engine served by :func:`serve` with the module's ``SERVER`` settings, for the module's tests."""
    with serve(engine, **request.module.SERVER) as running:
        yield running


@pytest.fixture(scope="module")
def client(request, server):
    """An `openai` client of the module's server (timeout: the module's ``CLIENT_TIMEOUT``, 60 s by default)."""
    return openai_client(server, timeout=getattr(request.module, "CLIENT_TIMEOUT", 60))
