"""The DiffusionGemma family: transformers' `DiffusionGemmaForBlockDiffusion`, fine-tuned as it is.

- ``modeling.py``: the canvas frame (where every row of a batch sits), the attention routing, encode / decode;
- ``training/objectives.py``: the `diffusion_gemma` objective (uniform-state noise, self-conditioning, the encoder's loss);
- ``sharded.py``: the rows each rank runs under ``cp`` / ``bp`` / ``csbp`` (the exchange: `hf_bdlm.parallel.exchange`);
- ``fsdp.py``: FSDP2 units (the tied encoder/decoder layer pairs); ``card.py``: the model card;
- ``serving.py``: how ``hf-bdlm serve`` decodes it (its own ``generate``, a random stream per request);
- ``family.py``: `DiffusionGemmaFamily`, what the trainer, plugin and hub call.
"""
