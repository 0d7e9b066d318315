"""The benchmarks ``hf-bdlm bench`` runs and ``hf-bdlm plan --validate`` predicts, shipped in the package.

- :mod:`.parallel_modes`: one training step of cp / bp / csbp (and the single process) per fresh launch; its model
  (:func:`~.parallel_modes.model_config`) is the one the planner's validation predicts.
- :mod:`.attention`: attention backends and a BDLM against an AR training step.
- :mod:`.max_context`: the longest trainable context under a per-rank memory cap.
- :mod:`.baselines`: csbp against both CP baselines and bp, with and without an emulated cluster link.
- :mod:`.decoding_study`, :mod:`.planning_study`: every family's decoding against greedy AR; the host's plan of a
  fresh layout (``--only decoding``, ``--only planning``).
- :mod:`.lm_eval_timing`, :mod:`.server_batching`: run alone (``python -m``): lm-eval's ``--model bdlm`` wall time at
  batch 1 and 8; ``hf-bdlm serve`` with and without batching, and under overload.
- :mod:`.matched_comparison`: what ``recipes/dg_matched.py`` records of each layout's fine-tune (a trainer callback),
  the step-time comparison and the figure.
- :mod:`.spread`: repeated timings (median and range) and comparisons (a tie where the ranges overlap), the one rule
  every timed study reports by.
- :mod:`.report`: fits, tables and plots of the records (pure functions of the JSON).
- :mod:`.suite`: the studies of ``hf-bdlm bench`` and their summary.
- :mod:`.bench_command`: ``hf-bdlm bench``'s arguments.
- :mod:`.processes`: how measurements start their fresh processes.

Each measurement runs in fresh processes started as ``python -m hf_bdlm.benchmarks.<module>`` (under torchrun for
the parallel modes), so an installed wheel runs them from any working directory. The committed records stay in the
repository's ``benchmarks/results/``.

    hf-bdlm bench --quick --out bench_quick
    python -m hf_bdlm.benchmarks.parallel_modes --quick --out /tmp/pm.json
"""
