"""SFT of a block diffusion LM (or AR -> BDLM conversion) with BDLMSFTTrainer and block parallelism.

The recipe lives in the library (:mod:`hf_bdlm.train`, also run by `hf-bdlm train`); this script is its
TRL-style entry point for `accelerate launch`:

    # the embedded CPU default: convert SmolLM2-135M-Instruct, fine-tune it with CSBP on 2 CPU processes
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/sft.py \\
        --config recipes/configs/smollm2_cpu_csbp.yaml
    # one process, any field overridden on the command line
    python recipes/sft.py --config recipes/configs/smollm2_cpu_csbp.yaml --block_parallel_size 1 --max_steps 5

See :mod:`hf_bdlm.train` for the arguments (TRL's `ScriptArguments`, `BDLMSFTConfig`, `ModelConfig`).
"""

from hf_bdlm.train import (  # noqa: F401  (the recipe's API, used by tests and scripts)
    BDLMSFTConfig,
    ModelConfig,
    SFTScriptArguments,
    held_out_exact_match,
    load_datasets,
    main,
    make_parser,
    resolve_model_path,
    run,
)

if __name__ == "__main__":
    run()
