"""Checkpoints on disk: the files of a model folder, and the ``checkpoint-N`` folders of a training run.

- :mod:`.files`: the checks of a model folder's files before they load (a safetensors file cut short or damaged, a
  ``config.json`` of another model: :class:`~.files.BadCheckpointFile`, naming the file and the fix), a file's sha256;
- :mod:`.atomic`: the atomic save of ``checkpoint-N`` (written into a staging folder, renamed into place once every
  rank has written) and the resume's side of it: the last complete checkpoint, an unfinished one refused.

Writing a model's folder for the Hub (card, remote code, upload) is :mod:`hf_bdlm.hub`'s. Nothing is imported here:
``from hf_bdlm.checkpoints.files import check_weight_files`` reads no torch and no transformers.
"""
