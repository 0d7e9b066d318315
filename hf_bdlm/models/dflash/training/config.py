"""`DFlashTrainingConfig`: `BDLMSFTConfig` plus what training a DFlash drafter needs (the target, the captured
features, the objective's options). Invalid values are refused when the config is built, naming the value and the fix.

    from hf_bdlm.models.dflash.training.config import DFlashTrainingConfig
    args = DFlashTrainingConfig("out", target_model="embedded:smollm2", features_dir="runs/features",
                                max_anchors=64, dflash_loss="dpace", max_steps=100,
                                block_parallel_size=2, block_parallel_mode="csbp")     # under a 2-process launch
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ....trainer.config import BDLMSFTConfig

# The objective options (DFlashObjectiveConfig's names, `dflash_loss` for its `loss`) and the config fields holding
# them: one table, read by the family to build the objective and to check the values.
OBJECTIVE_FIELDS = {
    "max_anchors": "max_anchors", "anchor_sampling": "anchor_sampling", "anchor_group_size": "anchor_group_size",
    "decay_gamma": "decay_gamma", "sample_from_anchor": "sample_from_anchor", "loss": "dflash_loss",
    "dpace_alpha": "dpace_alpha", "lk_loss_type": "lk_loss_type", "kl_scale": "kl_scale", "kl_decay": "kl_decay",
    "selector_loss_alpha": "selector_loss_alpha", "selector_warmup_ratio": "selector_warmup_ratio",
    "selector_ramp_ratio": "selector_ramp_ratio", "selector_stop_gradient": "selector_stop_gradient",
    "chunk_rows": "loss_chunk_rows",
}


@dataclass
class DFlashTrainingConfig(BDLMSFTConfig):
    r"""
    Configuration of the [`DFlashTrainer`]: every [`BDLMSFTConfig`] field (training loop, logging, checkpoints, block
    parallelism) plus the fields below. `objective` is `"dflash"`; `block_size` defaults to the drafter's (and must
    equal it when given).

    Parameters:
        > The target and its features

        target_model (`str`, *optional*):
            The frozen target causal LM the drafter drafts for: a local folder, a Hub id or `"embedded:smollm2"`. The
            trainer reads only its input embedding and LM head (and final norm for `dflash_loss="kl"`) from its
            weights files, and its tokenizer. Not needed when a bound drafter object is passed.
        target_revision (`str`, *optional*):
            The target's revision.
        features_dir (`str`, *optional*):
            A folder of captured target features (`hf-bdlm dflash capture`, `capture_features`): the training data
            when `train_dataset` is not given.
        eval_features_dir (`str`, *optional*):
            A folder of captured features of held-out records: the eval data when `eval_dataset` is not given. For
            `eval_acceptance_length` to be the acceptance `hf-bdlm serve --draft` reaches, capture the target's own
            greedy answers to held-out prompts (as `recipes/dflash.py` does).
        verify_features (`str`, defaults to `"size"`):
            What the trainer checks of each captured record against the capture's manifest before training: `"size"`
            (present and of its recorded size: a copy cut short; costs nothing) or `"sha256"` (also its sha256:
            any changed byte; reads the whole capture once, on every process).

        > The DFlash objective (`DFlashObjectiveConfig`'s options)

        max_anchors (`int`, defaults to `64`):
            Draft blocks (anchors) drawn per sequence and step. The published recipe's 2048 suits 1M-token sequences;
            each anchor costs `block_size` rows of the drafter and of the vocabulary projection.
        anchor_sampling (`str`, defaults to `"locality"`):
            `"locality"` (every `s`-th valid position from a random start) or `"uniform"`.
        anchor_group_size (`int`, defaults to `0`):
            Kept for recipe compatibility, in `[0, max_anchors]`.
        decay_gamma (`float`, defaults to `7.0`):
            Position weights `exp(-(k-1)/gamma)` of a block's slots.
        sample_from_anchor (`bool`, defaults to `False`):
            Slot `k` predicts `anchor + k + 1` (the anchor's slot supervised too).
        dflash_loss (`str`, defaults to `"dpace"`):
            `"ce"`, `"kl"` (needs features captured with `--teacher`) or `"dpace"` (DFlash2's acceptance-weighted loss,
            with the candidate selector's loss for a DFlash2 drafter).
        dpace_alpha (`float`, defaults to `0.5`), lk_loss_type (`str`, *optional*, defaults to `"lambda"`),
        kl_scale (`float`, defaults to `1.0`), kl_decay (`float`, defaults to `1.0`):
            D-PACE's smoothing and its CE / total-variation mix (`lk_loss_type`: `None` (write `none`), `"tv"` or
            `"lambda"`).
        selector_loss_alpha (`float`, defaults to `1.0`), selector_warmup_ratio (`float`, defaults to `0.0`),
        selector_ramp_ratio (`float`, defaults to `0.0`), selector_stop_gradient (`bool`, defaults to `False`):
            The candidate selector's loss weight and its schedule over training (`"dpace"` with a DFlash2 drafter).
        loss_chunk_rows (`int`, defaults to `4096`):
            Supervised rows per vocabulary projection of the loss (memory `rows x vocabulary`).
        draft_token_accuracy (`bool`, defaults to `True`):
            Log `mean_token_accuracy`: how often the drafter's first choice is the label, over the supervised slots
            (one more projection of those rows on the vocabulary, without gradient).

        > Served acceptance on the eval data

        eval_acceptance (`bool`, defaults to `True`):
            At each evaluation, also replay greedy speculative decoding over every eval record (its prompt, then its
            answer as the target's greedy completion; `hf_bdlm.models.dflash.training.acceptance`) and log
            `eval_acceptance_length` (tokens committed per verification step, counted as the server counts them) and
            `eval_verification_steps`. One drafter forward per step over a batch of records, no gradient.
        eval_num_speculative_tokens (`int`, *optional*):
            Proposals verified per step in that replay, `1 .. block_size - 1` (`None`: `block_size - 1`, the
            server's default; match `hf-bdlm serve --num-speculative-tokens`).

    Anchors: those of sequence `s` at optimizer step `t` are drawn by the objective from `(seed, s, t)` alone, so they
    do not depend on the data-parallel or block-parallel layout, on gradient accumulation, or on a resume.
    """

    target_model: str | None = field(default=None, metadata={"help": "The target causal LM (folder, Hub id, "
                                                                      "'embedded:smollm2')."})
    target_revision: str | None = field(default=None, metadata={"help": "The target's revision."})
    features_dir: str | None = field(default=None, metadata={"help": "Captured target features (hf-bdlm dflash "
                                                                     "capture): the training data."})
    eval_features_dir: str | None = field(default=None, metadata={"help": "Captured features of held-out records: "
                                                                          "the eval data."})
    verify_features: str = field(default="size", metadata={"help": "'size' or 'sha256': what the trainer checks "
                                                                   "of each captured record before training."})
    max_anchors: int = field(default=64, metadata={"help": "Anchors (draft blocks) per sequence and step."})
    anchor_sampling: str = field(default="locality", metadata={"help": "'locality' or 'uniform'."})
    anchor_group_size: int = field(default=0, metadata={"help": "Kept for recipe compatibility."})
    decay_gamma: float = field(default=7.0, metadata={"help": "Position weights exp(-(k-1)/gamma)."})
    sample_from_anchor: bool = field(default=False, metadata={"help": "Slot k predicts anchor + k + 1."})
    dflash_loss: str = field(default="dpace", metadata={"help": "'ce', 'kl' or 'dpace'."})
    dpace_alpha: float = field(default=0.5, metadata={"help": "D-PACE smoothing in [0, 1]."})
    lk_loss_type: str | None = field(default="lambda", metadata={"help": "'lambda', 'tv' or none (D-PACE's mix)."})
    kl_scale: float = field(default=1.0, metadata={"help": "The lambda mix's CE share scale."})
    kl_decay: float = field(default=1.0, metadata={"help": "The lambda mix's decay with the acceptance."})
    selector_loss_alpha: float = field(default=1.0, metadata={"help": "Weight of the candidate selector's loss."})
    selector_warmup_ratio: float = field(default=0.0, metadata={"help": "Share of training without selector loss."})
    selector_ramp_ratio: float = field(default=0.0, metadata={"help": "Share of training ramping the selector loss."})
    selector_stop_gradient: bool = field(default=False, metadata={"help": "The selector loss does not reach the "
                                                                          "drafter."})
    loss_chunk_rows: int = field(default=4096, metadata={"help": "Supervised rows per vocabulary projection."})
    draft_token_accuracy: bool = field(default=True, metadata={"help": "Log the drafter's token accuracy."})
    eval_acceptance: bool = field(default=True, metadata={"help": "Log the served acceptance length on the eval "
                                                                  "records (a replay of greedy speculative decoding)."})
    eval_num_speculative_tokens: int | None = field(default=None, metadata={"help": "Proposals per verification step "
                                                                                    "of that replay (default: B - 1)."})

    def __post_init__(self):
        if self.objective is None:
            self.objective = "dflash"
        if self.eval_num_speculative_tokens is not None and (
                isinstance(self.eval_num_speculative_tokens, bool) or not isinstance(self.eval_num_speculative_tokens, int)
                or self.eval_num_speculative_tokens < 1):
            raise ValueError(f"eval_num_speculative_tokens must be an integer >= 1 (at most the drafter's block size - "
                             f"1), got {self.eval_num_speculative_tokens!r}; leave it unset for block_size - 1.")
        if self.verify_features not in ("size", "sha256"):
            raise ValueError(f"verify_features must be 'size' or 'sha256', got {self.verify_features!r}.")
        if isinstance(self.lk_loss_type, str) and self.lk_loss_type.lower() in ("none", "null", ""):
            self.lk_loss_type = None  # a YAML / command-line spelling of "plain cross entropy"
        if getattr(self, "activation_checkpointing", None) is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = False  # a drafter is a few layers: recomputing them buys nothing
        super().__post_init__()

    def objective_options(self) -> dict:
        """The `DFlashObjectiveConfig` keyword arguments this config sets (all but the mask id, block size, seed)."""
        return {option: getattr(self, name) for option, name in OBJECTIVE_FIELDS.items()}


__all__ = ["DFlashTrainingConfig", "OBJECTIVE_FIELDS"]
