"""What a model family implements and how the rest of hf_bdlm finds one: the bottom of the package.

- ``family.py``: `ModelFamily`, the serving decoder (`ServingDecoder`), speculative decoding's `AcceptanceCounts` and
  lm-eval's likelihood scorer;
- ``step.py``: `TrainingStep`, the training step of a family whose objective drives its model's parts itself;
- ``card_parts.py``: what every family's model card shares;
- ``commands.py``: the tables a family declares its command line in (`Command`, `Argument`, `ExportFormat`, `Study`),
  which ``hf-bdlm`` builds its parsers from;
- ``registry.py``: the registry, one line per family naming the module of its `ModelFamily` subclass, imported on
  first use (as transformers' auto mappings and vLLM's model registry map names to module strings).

Nothing here imports another folder of the package: every other folder may import this one.
"""
