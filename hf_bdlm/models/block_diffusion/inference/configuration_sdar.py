"""`SDARConfig`: the configuration class an SDAR export ships beside its weights (``config.json``'s ``auto_map``).

SGLang and LMDeploy recognise a block-diffusion Qwen3 as SDAR by ``model_type: "sdar"`` and
``architectures: ["SDARForCausalLM"]``, and build its layers from the Qwen3 fields of the config they load with
``AutoConfig.from_pretrained(path, trust_remote_code=True)``. transformers knows no ``sdar`` model type, so the folder
carries this class. It stores every field the engines read as a plain attribute, ``rope_theta`` included: SGLang reads
``config.rope_theta`` (with 10000 as its fallback), which transformers 5's ``Qwen3Config`` no longer has.

This file is copied as is into exported folders (``hf_bdlm.models.block_diffusion.inference.export_sdar``); it imports nothing
but transformers, so it loads where hf_bdlm is not installed.

    from transformers import AutoConfig
    config = AutoConfig.from_pretrained("out/sdar", trust_remote_code=True)
    config.rope_theta, config.block_size, config.mask_token_id
"""

from transformers import PretrainedConfig


class SDARConfig(PretrainedConfig):
    r"""
    Configuration of a dense SDAR model: a Qwen3 decoder decoded block by block with an absorbing `[MASK]` token and
    no token shift (the logit at position `i` predicts token `i`).

    Parameters:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
        head_dim, hidden_act, max_position_embeddings, initializer_range, rms_norm_eps, attention_bias,
        attention_dropout, max_window_layers:
            As in `Qwen3Config`.
        rope_theta (`float`, defaults to 1000000.0):
            The RoPE base, stored as an attribute of its own (the serving engines read it there).
        use_sliding_window (`bool`, defaults to `False`), sliding_window (`int`, *optional*):
            No sliding window: SDAR layers attend to the whole clean prefix.
        tie_word_embeddings (`bool`, defaults to `False`):
            Whether the LM head is the input embedding.
        block_size (`int`, defaults to 4):
            The block size the model was trained with. Informational: the engines take theirs from launch flags.
        mask_token_id (`int`, defaults to 151669):
            The `[MASK]` id. Informational: both engines hard-code 151669.
    """

    model_type = "sdar"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=32768,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=None,
        block_size=4,
        mask_token_id=151669,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window
        self.max_window_layers = max_window_layers if max_window_layers is not None else num_hidden_layers
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        # Set here as well as in the base class: LMDeploy reads these three without a default, and transformers 5
        # no longer gives a config a pad_token_id of its own.
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


__all__ = ["SDARConfig"]
