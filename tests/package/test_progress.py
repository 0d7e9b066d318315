"""Progress bars of long work (hf_bdlm.progress): the rule (standard error, rank 0, a terminal unless
HF_BDLM_PROGRESS says otherwise), and each bar counts what its work does: `hf-bdlm generate` the tokens it prints,
held-out exact match its prompts, lm-eval's `bdlm` model its requests (moved once per batch), a DFlash capture its
records, `hf-bdlm plan --paper` every configuration it prices. Standard output is the same with and without bars.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from fixtures import tiny_target
from tiny_bdlm import save_tiny_bdlm, tiny_bdlm, tiny_tokenizer

import hf_bdlm.progress as progress
from hf_bdlm.cli import build_parser, main


class Bars:
    """Every bar :func:`hf_bdlm.progress.progress_bar` makes (its tqdm class swapped for a recording one)."""

    def __init__(self, monkeypatch):
        self.made = []
        made = self.made

        class Recording(progress.tqdm):
            def __init__(self, *args, **kwargs):
                self.label = kwargs.get("desc") or ""  # a disabled tqdm keeps no desc
                super().__init__(*args, **kwargs)
                made.append(self)

        monkeypatch.setattr(progress, "tqdm", Recording)

    def named(self, desc: str) -> list:
        return [bar for bar in self.made if bar.label.startswith(desc)]


@pytest.fixture
def bars(monkeypatch):
    """Bars drawn (off a terminal too: HF_BDLM_PROGRESS=1) and recorded."""
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    monkeypatch.delenv("RANK", raising=False)
    return Bars(monkeypatch)


def test_a_bar_is_drawn_on_rank_0_on_a_terminal_or_as_the_environment_says(monkeypatch):
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert progress.bar_disabled() is None  # tqdm's rule: a terminal only
    assert progress.bar_disabled(enabled=False) is True
    monkeypatch.setenv("RANK", "1")
    assert progress.bar_disabled() is True and not progress.main_process()
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    assert progress.bar_disabled() is True  # never off rank 0
    monkeypatch.setenv("RANK", "0")
    assert progress.bar_disabled() is False
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")
    assert progress.bar_disabled() is True
    monkeypatch.setenv(progress.PROGRESS_ENV, "yes")
    with pytest.raises(ValueError, match="HF_BDLM_PROGRESS='yes'"):
        progress.bar_disabled()
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    with progress.progress_bar(total=3) as bar:
        assert bar.fp == sys.stderr


def test_off_a_terminal_no_bar_is_drawn(monkeypatch, capsys):
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    for _ in progress.progress_bar(range(3), desc="quiet"):
        progress.write("line")
    out, err = capsys.readouterr()
    assert out == "line\n" * 3 and err == ""


def test_generate_shows_the_tokens_on_standard_error_and_prints_the_same_text(tmp_path, bars, capsys, monkeypatch):
    folder = save_tiny_bdlm(tmp_path / "bdlm")
    argv = ["generate", str(folder), "w7 w8 w9", "--max-new-tokens", "10"]
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")
    assert main(argv) == 0
    quiet, quiet_err = capsys.readouterr()
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    assert main(argv) == 0
    shown, shown_err = capsys.readouterr()
    assert shown == quiet and len(quiet.split()) == 10  # the tiny model has no EOS: every token is generated
    [bar] = bars.named("generating")[-1:]
    assert bar.total == bar.n == 10
    assert "generating" in shown_err and "10/10" in shown_err and "generating" not in quiet_err


def test_a_streamer_gets_the_prompt_then_every_block_of_new_tokens():
    model, tokenizer = tiny_bdlm(), tiny_tokenizer()
    prompt = torch.tensor([tokenizer("w7 w8 w9 w10 w11")["input_ids"]])

    class Streamer:
        def __init__(self):
            self.calls, self.ended = [], False

        def put(self, value):
            self.calls.append(value.tolist())

        def end(self):
            self.ended = True

    streamer = Streamer()
    out = model.generate(prompt, max_new_tokens=9, streamer=streamer)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=9))
    assert streamer.calls[0] == prompt.tolist() and streamer.ended
    # Block size 4, a prompt of 5 tokens: the first block finishes the prompt's, then whole blocks, cut at the budget.
    assert [len(c) for c in streamer.calls[1:]] == [3, 4, 2]
    assert sum(streamer.calls[1:], []) == out[0, prompt.shape[1]:].tolist()
    with pytest.raises(ValueError, match="one prompt"):
        model.generate(prompt.repeat(2, 1), max_new_tokens=4, streamer=streamer)


def test_held_out_exact_match_counts_its_prompts(bars):
    from hf_bdlm.evaluation.exact_match import held_out_exact_match

    examples = [{"prompt": [{"role": "user", "content": f"w{7 + i}"}], "answer": "w9"} for i in range(3)]
    held_out_exact_match(tiny_bdlm(), tiny_tokenizer(), examples)
    [bar] = bars.named("held-out exact match")
    assert bar.total == bar.n == len(examples)
    held_out_exact_match(tiny_bdlm(), tiny_tokenizer(), examples, progress=False)
    assert bars.named("held-out exact match")[-1].disable


def test_lm_evals_bdlm_model_counts_its_requests_once_per_batch(bars):
    pytest.importorskip("lm_eval", reason="needs lm-eval (dev / lmeval extra)")
    from hf_bdlm.evaluation.lm_eval_model import HFBDLMEvalModel

    class Request:
        def __init__(self, *args):
            self.args = args

    lm = HFBDLMEvalModel(model=tiny_bdlm(), tokenizer=tiny_tokenizer(), batch_size=2, mc_num=2, max_gen_toks=4)
    lm.generate_until([Request(f"w{7 + i} w{8 + i}", {"until": ["\n"]}) for i in range(3)])
    [bar] = bars.named("bdlm generate_until")
    assert bar.total == bar.n == 3
    scored = lm._loglikelihood_tokens([(None, (2, 7 + i), (8 + i, 9 + i)) for i in range(5)])
    [bar] = bars.named("bdlm loglikelihood")
    assert bar.total == bar.n == len(scored) == 5
    # The scorer reports each forward: 5 requests of one geometry at batch size 2 are 3 forwards.
    updates = []
    lm.scorer.score(_score_requests(5), mc_num=2, seed=0, batch_size=2, on_batch=updates.append)
    assert updates == [2, 2, 1]
    lm.generate_until([Request("w7 w8", {"until": ["\n"]})], disable_tqdm=True)
    assert bars.named("bdlm generate_until")[-1].disable


def _score_requests(n: int):
    from hf_bdlm.protocols.likelihood import ScoreRequest

    return [ScoreRequest((2, 7 + i), (8 + i, 9 + i)) for i in range(n)]


def test_a_capture_counts_its_records_once_per_batch(tmp_path, bars):
    from hf_bdlm.models.dflash.training.capture import capture_features

    target = tiny_target("llama", num_hidden_layers=2, max_position_embeddings=64, pad_token_id=1, eos_token_id=3)
    records = [{"input_ids": [2, 4, 7 + i, 8 + i, 3], "labels": [-100, -100, 7 + i, 8 + i, 3]} for i in range(5)]
    capture_features(target, records, layer_ids=(0, 2), out_dir=tmp_path / "features", batch_size=2,
                     target_id="org/tiny")
    [bar] = bars.named("capturing target features")
    assert bar.total == bar.n == len(records)


def test_plan_paper_counts_every_configuration_and_prints_the_same_tables(bars, monkeypatch, capsys):
    import hf_bdlm.planner.plan_command as plan_cli
    import hf_bdlm.protocols.registry as registry

    # One short setting and a family section that prices nothing: the code path of the paper's settings, in seconds.
    monkeypatch.setattr(plan_cli, "paper_settings", lambda: (("test setting", "gemma3-27b", 4096, "none", "tp"),))
    monkeypatch.setattr(type(registry.family_named("dflash").role("planning")), "paper_projection",
                        lambda self, _: "a family section")
    args = build_parser().parse_args(["plan", "--paper"])
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")
    assert plan_cli.run_paper(args) == 0
    quiet, _ = capsys.readouterr()
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    assert plan_cli.run_paper(args) == 0
    shown, err = capsys.readouterr()
    assert shown == quiet and "test setting" in shown and "\na family section\n" in shown
    [bar] = bars.named("plan --paper")[-1:]
    total = 1 * (2 + len(plan_cli.SENSITIVITY)) + len(registry.REGISTRY)
    assert bar.total == bar.n == total and f"{total}/{total}" in err


if __name__ == "__main__":
    sys.exit(pytest.main([str(Path(__file__)), "-q"]))
