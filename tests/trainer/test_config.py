"""BDLMSFTConfig and BlockParallelPlugin: defaults, and every invalid value rejected at construction."""

import pytest

from hf_bdlm import BDLMSFTConfig, BlockParallelPlugin


def make(tmp_path, **kw) -> BDLMSFTConfig:
    return BDLMSFTConfig(output_dir=str(tmp_path / "out"), report_to="none", **kw)


def test_defaults_resolve_the_clean_ring_and_train_in_float32_on_cpu(tmp_path):
    args = make(tmp_path)
    assert args.block_parallel_size == 1 and args.clean_ring_size == 1
    assert args.block_parallel_mode == "csbp" and args.block_schedule == "dual_end"
    assert args.block_parallel_transport == "allgather"
    assert args.bf16 is False  # TRL's default is True; only GPUs get bf16 by default
    assert args.ddp_find_unused_parameters is False
    assert args.overlong_samples == "error"
    assert args.data_parallel_size == 1


def test_bp_mode_has_no_clean_ring(tmp_path):
    assert make(tmp_path, block_parallel_mode="bp").clean_ring_size == 1


def test_parallelism_config_gives_the_tensor_parallel_size_and_nothing_else(tmp_path):
    from accelerate import ParallelismConfig

    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the world size 1"):
        make(tmp_path, parallelism_config=ParallelismConfig(tp_size=2))
    for name, instead in (("cp_size", "block parallelism is this trainer's context parallelism"),
                          ("dp_shard_size", "FSDP2 is requested with fsdp='full_shard'"),
                          ("dp_replicate_size", "the data-parallel replicas are the ranks left over")):
        with pytest.raises(ValueError, match=rf"parallelism_config.{name}=2 is not supported by BDLMSFTTrainer: "
                                             rf"{instead}"):
            make(tmp_path, parallelism_config=ParallelismConfig(**{name: 2}))
    assert make(tmp_path, parallelism_config=ParallelismConfig(tp_size=1)).parallel_dims.tensor_parallel_size == 1


def test_parallelism_config_of_an_accelerate_launch_is_read(tmp_path, monkeypatch):
    # `accelerate launch` with a parallelism_config section exports its sizes; the config reads them as Accelerate does.
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the world size 1"):
        make(tmp_path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=0), "block_size must be a positive integer, got 0"),
        (dict(objective="bd3lm"), "objective must be one of .* got 'bd3lm'"),
        (dict(objective="dflash", noise_eps_min=0.1), r"\['noise_eps_min'\] are block-diffusion settings and do not "
                                                      "apply to objective='dflash'"),
        (dict(noise_eps_min=0.0), r"noise_eps_min must lie in \(0, 1\], got 0.0"),
        (dict(noise_eps_min=0.5, noise_eps_max=0.2), "noise_eps_min <= noise_eps_max"),
        (dict(loss_weighting="sqrt"), "loss_weighting must be one of"),
        (dict(objective="fast_dllm_v2", loss_weighting="inverse_t"), "fast_dllm_v2' uses unit weights"),
        (dict(attention_backend="sdpa"), "attention_backend must be one of"),
        (dict(certainty_weight=-0.5), r"certainty_weight must be a finite number >= 0 .* got -0.5"),
        (dict(objective="dflash", certainty_weight=1.0), r"\['certainty_weight'\] are block-diffusion settings and "
                                                         "do not apply to objective='dflash'"),
        (dict(block_parallel_size=0), "block_parallel_size must be a positive integer, got 0"),
        (dict(block_parallel_mode="ulysses"), "block_parallel_mode must be one of .* got 'ulysses'"),
        (dict(block_schedule="zigzag"), "block_schedule must be one of"),
        (dict(block_parallel_transport="nccl"), "block_parallel_transport must be one of"),
        (dict(clean_ring_size=2), "clean_ring_size=2 does not divide group_size=1"),
        (dict(block_parallel_mode="bp", clean_ring_size=2), "mode='bp' has no clean ring"),
        (dict(block_parallel_mode="cp", block_schedule="contiguous"), "mode='cp' always shards"),
        (dict(overlong_samples="ignore"), "overlong_samples must be one of"),
        (dict(ddp_find_unused_parameters=True), "ddp_find_unused_parameters=True is not supported"),
    ],
)
def test_invalid_values_are_rejected_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **kwargs)


def test_block_parallel_size_must_divide_the_world_size(tmp_path):
    with pytest.raises(ValueError, match=r"block_parallel_size=2 does not divide the world size 1.*Choose one of \[1\]"):
        make(tmp_path, block_parallel_size=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(packing=True, packing_strategy="wrapped"), "'wrapped' cannot be honoured.*cuts documents"),
        (dict(packing=True, packing_strategy="bfd_split"), "'bfd_split' cannot be honoured.*splits"),
        (dict(padding_free=True, max_length=None), "padding_free=True flattens a batch"),
        (dict(packing=True, max_length=None), "packing=True needs max_length"),
        (dict(packing=True, block_size=16, max_length=100), "max_length=100 must be a multiple of block_size=16"),
    ],
)
def test_packing_that_cannot_keep_block_aligned_documents_is_rejected(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **kwargs)


def test_plugin_is_built_from_the_config_fields(tmp_path):
    args = make(tmp_path, block_parallel_mode="bp", block_schedule="contiguous")
    plugin = BlockParallelPlugin.from_config(args)
    assert (plugin.block_parallel_size, plugin.clean_ring_size, plugin.mode, plugin.schedule, plugin.transport) == (
        1, 1, "bp", "contiguous", "allgather")


def test_plugin_validates_like_the_config():
    with pytest.raises(ValueError, match="clean_ring_size=3 does not divide group_size=4"):
        BlockParallelPlugin(block_parallel_size=4, clean_ring_size=3)
    with pytest.raises(ValueError, match="transport must be one of"):
        BlockParallelPlugin(transport="carrier-pigeon")
    assert BlockParallelPlugin(block_parallel_size=4).clean_ring_size == 4


def test_plugin_needs_setup_before_it_shards_data():
    with pytest.raises(RuntimeError, match=r"setup\(\) has not been called"):
        BlockParallelPlugin().batch_sampler(10, 2)


def test_plugin_pads_to_what_the_layout_needs():
    plugin = BlockParallelPlugin(block_parallel_size=2)
    assert plugin.pad_multiple(4) == 16  # csbp dual-end: 2 * P blocks
    assert BlockParallelPlugin(block_parallel_size=2, mode="cp").pad_multiple(4) == 8
    assert BlockParallelPlugin().pad_multiple(4) == 4  # P = 1: the block size


def test_checkpointing_defaults_on_under_the_current_name_and_honours_the_old_one(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the default must not trip transformers' deprecation
        default = make(tmp_path)
    assert default.activation_checkpointing is True and default.gradient_checkpointing is True
    assert make(tmp_path, activation_checkpointing=False).gradient_checkpointing is False
    with pytest.warns(FutureWarning, match="gradient_checkpointing"):
        old = make(tmp_path, gradient_checkpointing=False)
    assert old.activation_checkpointing is False
