"""DFlash target-feature capture: the stored features are the target's hidden states (batch 1 bitwise, padded batches
to float32 rounding), the teacher state is the pre-norm last layer output, the records are the trainer's own
tokenisation, a rerun resumes (skips what is intact, redoes what is not), and the reader serves row ranges and
catches a capture that does not fit the drafter.
"""

import functools
import json
from types import SimpleNamespace

import datasets
from embedded_model import needs_embedded_model
import fixtures
import pytest
import torch
from tiny_bdlm import tiny_bdlm, tiny_tokenizer
from transformers import LlamaForCausalLM

import hf_bdlm.models.dflash.training.capture as capture_module
from hf_bdlm.models.dflash.training.capture import FeatureStore, capture_features, tokenize_records

LAYERS = (0, 1, 3)  # embeddings, a middle layer, the final norm's output (3 layers)
TOKENS = [[2, 4, 7, 8, 9, 3, 2, 5, 10, 11, 3], [2, 4, 12, 13, 3], [2, 4, 7, 8, 9, 14, 15, 16, 3, 2, 5, 17, 3],
          [5, 6], [2, 4, 20, 21, 22, 3, 2, 5, 23, 3]]


tiny_target = functools.partial(fixtures.tiny_target, max_position_embeddings=128, pad_token_id=1, eos_token_id=3)


def records(tokens=TOKENS):
    return [{"input_ids": ids, "labels": [-100] * (len(ids) // 2) + ids[len(ids) // 2:]} for ids in tokens]


def direct(target, ids, layers=LAYERS):
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1)[0], out.hidden_states


def capture(target, out, rows=None, **kw):
    kw = {"layer_ids": LAYERS, "progress": False, "target_id": "org/tiny", **kw}
    return capture_features(target, records() if rows is None else rows, out_dir=out, **kw)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_batch_of_one_stores_exactly_the_hidden_states_of_a_plain_forward(tmp_path, kind):
    target = tiny_target(kind)
    manifest = capture(target, tmp_path / "f", batch_size=1)
    store = FeatureStore(tmp_path / "f")
    assert len(store) == len(TOKENS) and store.lengths == [len(t) for t in TOKENS]
    assert manifest["feature_width"] == 3 * 32 and manifest["layer_ids"] == list(LAYERS)
    for i, ids in enumerate(TOKENS):
        expected, _ = direct(target, ids)
        assert torch.equal(store.features(i), expected), i
        input_ids, loss_mask = store.record(i)
        assert input_ids.tolist() == ids and input_ids.dtype == torch.long
        assert loss_mask.tolist() == [False] * (len(ids) // 2) + [True] * (len(ids) - len(ids) // 2)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_padded_batches_of_three_store_each_records_own_features(tmp_path, kind):
    target = tiny_target(kind)
    capture(target, tmp_path / "f", batch_size=3, teacher=True)
    store = FeatureStore(tmp_path / "f")
    worst = 0.0
    for i, ids in enumerate(TOKENS):
        expected, states = direct(target, ids)
        worst = max(worst, (store.features(i) - expected).abs().max().item())
        # The teacher state is the last layer's output before the final norm: the norm maps it onto the tuple's last
        # entry, which it is not itself.
        teacher = store.teacher(i)
        assert teacher.shape == (len(ids), 32)
        torch.testing.assert_close(target.model.norm(teacher), states[-1][0], rtol=0, atol=1e-5)
        assert not torch.allclose(teacher, states[-1][0])
    assert worst <= 1e-5, worst  # right padding never reaches a real token (only rounding differs)


def test_records_are_the_trainers_own_tokenisation(tmp_path):
    from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer

    dataset = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": "w7 w8 w9"}], "completion": [{"role": "assistant", "content": "w10"}]},
        {"prompt": [{"role": "user", "content": "w12"}], "completion": [{"role": "assistant", "content": "w13 w14"}]},
    ])
    ours = tokenize_records(dataset, tiny_tokenizer())
    trainer = BDLMSFTTrainer(tiny_bdlm(), args=BDLMSFTConfig(str(tmp_path), report_to="none", max_length=64,
                                                             disable_tqdm=True),
                             train_dataset=dataset, processing_class=tiny_tokenizer())
    assert ours["input_ids"] == trainer.train_dataset["input_ids"]
    assert ours["labels"] == trainer.train_dataset["labels"]
    assert ours[0]["input_ids"] == [2, 4, 7, 8, 9, 3, 2, 5, 10, 3]
    assert ours[0]["labels"] == [-100] * 8 + [10, 3]  # the prompt is not supervised


def test_a_rerun_skips_intact_records_and_redoes_a_corrupted_one(tmp_path, monkeypatch):
    target = tiny_target()
    first = capture(target, tmp_path / "f", batch_size=2)
    written = []
    original = capture_module._write_record
    monkeypatch.setattr(capture_module, "_write_record", lambda root, i, t: written.append(i) or original(root, i, t))
    assert capture(target, tmp_path / "f", batch_size=2) == first and written == []

    path = tmp_path / "f" / first["records"][2]["file"]
    data = bytearray(path.read_bytes())
    data[-8:] = b"\x7f" * 8  # the last feature values
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"1 of 5 records .* fail verification: \['records/00000002.safetensors "
                                         r"\(sha256 differs\)'\]"):
        FeatureStore(tmp_path / "f").verify()
    assert capture(target, tmp_path / "f", batch_size=2) == first and written == [2]
    FeatureStore(tmp_path / "f").verify()


def test_an_interrupted_capture_is_incomplete_and_a_rerun_finishes_only_the_rest(tmp_path, monkeypatch):
    target = tiny_target()
    calls = []
    original = capture_module._forward

    def crash_on_second_batch(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(capture_module, "_forward", crash_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        capture(target, tmp_path / "f", batch_size=2)
    (tmp_path / "f" / "records" / ".00000002.safetensors.tmp").write_bytes(b"half")  # a file cut short
    with pytest.raises(ValueError, match=r"incomplete \(2 of 5 records written\); rerun it"):
        FeatureStore(tmp_path / "f")
    written = []
    monkeypatch.setattr(capture_module, "_forward", original)
    write = capture_module._write_record
    monkeypatch.setattr(capture_module, "_write_record", lambda root, i, t: written.append(i) or write(root, i, t))
    capture(target, tmp_path / "f", batch_size=2)
    assert written == [2, 3, 4]
    store = FeatureStore(tmp_path / "f")
    store.verify()
    assert torch.equal(store.features(0), direct(target, TOKENS[0])[0])


def test_a_record_whose_tokens_changed_is_recaptured_and_new_records_extend_the_capture(tmp_path, monkeypatch):
    target = tiny_target()
    capture(target, tmp_path / "f")
    changed = [list(t) for t in TOKENS]
    changed[1][2] = 30
    written = []
    write = capture_module._write_record
    monkeypatch.setattr(capture_module, "_write_record", lambda root, i, t: written.append(i) or write(root, i, t))
    capture(target, tmp_path / "f", rows=records(changed))
    assert written == [1]
    assert FeatureStore(tmp_path / "f").record(1)[0].tolist() == changed[1]
    written.clear()
    capture(target, tmp_path / "f", rows=records(changed + [[2, 4, 9, 3]]))  # more records: only the new one runs
    assert written == [5] and len(FeatureStore(tmp_path / "f")) == 6


def test_resuming_with_other_settings_is_a_clear_error(tmp_path):
    target = tiny_target()
    capture(target, tmp_path / "f")
    with pytest.raises(ValueError, match=r"holds a capture with other settings \(layer_ids: \[0, 1, 3\] there, "
                                         r"\[1, 2\] now.*new folder, or pass resume=False"):
        capture(target, tmp_path / "f", layer_ids=(1, 2))
    capture(target, tmp_path / "f", layer_ids=(1, 2), resume=False)
    assert FeatureStore(tmp_path / "f").layer_ids == (1, 2)


def test_the_store_reads_row_ranges_equal_to_slices_of_the_full_record(tmp_path):
    target = tiny_target()
    capture(target, tmp_path / "f", teacher=True)
    store = FeatureStore(tmp_path / "f")
    full = store.features(2)
    assert full.shape == (13, 96) and full.dtype == torch.float32
    for start, stop in ((0, 13), (3, 9), (12, 13), (5, 5)):
        assert torch.equal(store.features(2, start, stop), full[start:stop])
        assert torch.equal(store.teacher(2, start, stop), store.teacher(2)[start:stop])
    manifest = json.loads((tmp_path / "f" / "manifest.json").read_text())
    assert manifest["target"]["id"] == "org/tiny" and manifest["dtype"] == "float32"
    assert manifest["records"][2]["length"] == 13 and len(manifest["records"][2]["sha256"]) == 64
    with pytest.raises(ValueError, match=r"rows 4:14 are outside record 2, which has 13 tokens"):
        store.features(2, 4, 14)
    with pytest.raises(IndexError, match=r"record 5 is out of range: the capture holds 5 records"):
        store.record(5)


def test_a_capture_that_does_not_fit_the_drafter_is_a_clear_error(tmp_path):
    capture(tiny_target(), tmp_path / "f")
    store = FeatureStore(tmp_path / "f")
    store.check_drafter(SimpleNamespace(target_layer_ids=LAYERS, target_hidden_size=32), target_id="org/tiny")
    with pytest.raises(ValueError, match=r"reads target layers \[1, 2, 3\], the capture holds \[0, 1, 3\]"):
        store.check_drafter(SimpleNamespace(target_layer_ids=(1, 2, 3), target_hidden_size=32))
    with pytest.raises(ValueError, match=r"fc takes 192 features \(3 x 64\), the capture's width is 96"):
        store.check_drafter(SimpleNamespace(target_layer_ids=LAYERS, target_hidden_size=64))
    with pytest.raises(ValueError, match=r"for target 'org/other', the features are of 'org/tiny'"):
        store.check_drafter(SimpleNamespace(target_layer_ids=LAYERS, target_hidden_size=32), target_id="org/other")


def test_bad_inputs_are_clear_errors(tmp_path):
    target = tiny_target()
    with pytest.raises(ValueError, match=r"layer_ids \[4\] are outside the target's hidden states 0..3"):
        capture(target, tmp_path / "a", layer_ids=(1, 4))
    with pytest.raises(ValueError, match=r"layer_ids \[1, 1\] repeat an id"):
        capture(target, tmp_path / "b", layer_ids=(1, 1))
    with pytest.raises(ValueError, match=r"needs 'input_ids' \(tokenise the dataset first"):
        capture(target, tmp_path / "c", rows=[{"text": "w7"}])
    with pytest.raises(FileNotFoundError, match=r"holds no manifest.json: it is not a capture folder"):
        FeatureStore(tmp_path / "nothing")


def test_the_capture_command_runs_on_a_saved_target(tmp_path):
    from hf_bdlm.cli import main

    tiny_target().save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    argv = ["dflash", "capture", "--target", str(tmp_path / "target"), "--dataset", "hf_bdlm:arith",
            "--layer-ids", "1", "2", "--out", str(tmp_path / "f"), "--max-records", "3", "--max-length", "48",
            "--batch-size", "2", "--teacher", "--quiet"]
    assert main(argv) == 0
    store = FeatureStore(tmp_path / "f")
    assert len(store) == 3 and store.layer_ids == (1, 2) and store.has_teacher
    assert store.manifest["target"]["id"] == str(tmp_path / "target")
    ids, mask = store.record(0)
    assert mask.any() and not mask.all() and len(ids) <= 48
    target = LlamaForCausalLM.from_pretrained(tmp_path / "target").eval()
    torch.testing.assert_close(store.features(0), direct(target, ids.tolist(), (1, 2))[0], rtol=0, atol=1e-5)
    assert main(argv) == 0  # a rerun resumes: nothing to do


@needs_embedded_model
def test_the_capture_command_takes_the_embedded_target(tmp_path):
    """On a fresh machine the first use exports the embedded model into the cache home, as any command does."""
    from hf_bdlm.cli import main

    assert main(["dflash", "capture", "--target", "embedded:smollm2", "--dataset", "hf_bdlm:arith", "--layer-ids",
                 "1", "30", "--out", str(tmp_path / "f"), "--max-records", "2", "--max-length", "64", "--quiet"]) == 0
    store = FeatureStore(tmp_path / "f")
    assert store.feature_width == 2 * 576 and store.manifest["target"]["id"] == "embedded:smollm2"
