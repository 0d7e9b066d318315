"""Data side of BDLMSFTTrainer: every TRL format collated block-aligned with the right supervision,
block-aligned packing, the length policy, the group-shared sampler, and bad input caught early.
"""


import datasets
import pytest
import torch

from trainer_common import (  # noqa: E402
    PAD,
    language_modeling,
    messages,
    prompt_completion,
    tiny_bdlm,
    tiny_tokenizer,
)

from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer  # noqa: E402
from hf_bdlm.parallel.plugin import BlockParallelBatchSampler  # noqa: E402
from hf_bdlm.trainer.collator import SAMPLE_ID_COLUMN, BlockAlignedCollator  # noqa: E402

BLOCK = 4


def make_trainer(tmp_path, dataset, model=None, peft_config=None, **kw):
    args = dict(output_dir=str(tmp_path / "out"), report_to="none", per_device_train_batch_size=2, max_length=64,
                disable_tqdm=True, activation_checkpointing=False)
    args.update(kw)
    return BDLMSFTTrainer(model or tiny_bdlm(block_size=BLOCK), args=BDLMSFTConfig(**args), train_dataset=dataset,
                          processing_class=tiny_tokenizer(), peft_config=peft_config)


def first_batch(trainer, n=2):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(n)])


def supervised_text(batch, row=0):
    tok = tiny_tokenizer()
    ids = batch["input_ids"][row]
    return tok.decode(ids[batch["completion_mask"][row].bool()])


# --- the collator ------------------------------------------------------------------------------------
def test_collator_pads_to_the_block_multiple_and_never_supervises_pads():
    collate = BlockAlignedCollator(pad_token_id=PAD, block_size=4)
    batch = collate([
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9], SAMPLE_ID_COLUMN: 3},
        {"input_ids": [5, 6], "labels": [-100, 6], SAMPLE_ID_COLUMN: 0},
    ])
    assert batch["input_ids"].shape == (2, 8)
    assert batch["input_ids"][0].tolist() == [5, 6, 7, 8, 9, PAD, PAD, PAD]
    assert batch["attention_mask"][1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert batch["completion_mask"][0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert batch["completion_mask"][1].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]
    assert batch["sample_ids"].tolist() == [3, 0]
    assert "document_ids" not in batch


def test_collator_pads_to_the_layout_multiple_when_asked():
    collate = BlockAlignedCollator(pad_token_id=PAD, block_size=4, pad_to_multiple_of=16)
    batch = collate([{"input_ids": [5] * 17, "labels": [5] * 17, SAMPLE_ID_COLUMN: 0}])
    assert batch["input_ids"].shape == (1, 32)
    with pytest.raises(ValueError, match="pad_to_multiple_of=6 must be a multiple of block_size=4"):
        BlockAlignedCollator(pad_token_id=PAD, block_size=4, pad_to_multiple_of=6)


def test_an_empty_share_collates_to_one_unsupervised_row():
    batch = BlockAlignedCollator(pad_token_id=PAD, block_size=4, pad_to_multiple_of=8)([])
    assert batch["input_ids"].shape == (1, 8) and batch["completion_mask"].sum() == 0
    assert batch["sample_ids"].tolist() == [-1]


def test_collator_refuses_rows_without_a_global_sample_id():
    with pytest.raises(KeyError, match=SAMPLE_ID_COLUMN):
        BlockAlignedCollator(pad_token_id=PAD, block_size=4)([{"input_ids": [1, 2], "labels": [1, 2]}])


# --- every TRL format ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dataset, kwargs, expected",
    [
        (prompt_completion(4), {}, "0 yes no <|im_end|>"),  # conversational prompt-completion: completion only
        (prompt_completion(4, conversational=False), {}, "0 yes no </s>"),  # standard prompt-completion + EOS
        (prompt_completion(4), dict(completion_only_loss=False),
         "<|im_start|> user what is the sum of 0 and 0 <|im_end|> <|im_start|> assistant 0 yes no <|im_end|>"),
        (messages(4), dict(assistant_only_loss=True), "0 yes no <|im_end|> a b c <|im_end|>"),
        (language_modeling(4), {}, "what is the sum of 0 and 0 0 yes no </s>"),  # language modeling: everything
    ],
    ids=["prompt_completion_chat", "prompt_completion_text", "completion_only_off", "assistant_only", "text"],
)
def test_each_dataset_format_supervises_the_right_tokens(tmp_path, dataset, kwargs, expected):
    trainer = make_trainer(tmp_path, dataset, **kwargs)
    batch = first_batch(trainer)
    assert batch["input_ids"].shape[1] % BLOCK == 0
    assert supervised_text(batch) == expected
    assert not (batch["completion_mask"].bool() & ~batch["attention_mask"].bool()).any()


def test_conversational_messages_supervise_every_turn_without_assistant_only_loss(tmp_path):
    batch = first_batch(make_trainer(tmp_path, messages(4)))
    assert supervised_text(batch).startswith("<|im_start|> system")


def test_pretokenized_rows_use_their_completion_mask(tmp_path):
    rows = datasets.Dataset.from_dict({"input_ids": [[5, 7, 8, 9, 10], [5, 11, 12]],
                                       "completion_mask": [[0, 0, 1, 1, 1], [0, 1, 1]]})
    batch = first_batch(make_trainer(tmp_path, rows, completion_only_loss=True))
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]


def test_global_sample_ids_survive_tokenization_and_column_removal(tmp_path):
    data = prompt_completion(8)
    trainer = make_trainer(tmp_path, data, shuffle_dataset=True)
    tok = tiny_tokenizer()
    seen = []
    for batch in trainer.get_train_dataloader():
        for row, sample in enumerate(batch["sample_ids"].tolist()):
            question = data[sample]["prompt"][0]["content"]
            assert question in tok.decode(batch["input_ids"][row]), (sample, question)
            seen.append(sample)
    assert sorted(seen) == list(range(8))


# --- block-aligned packing -----------------------------------------------------------------------
def test_packing_aligns_every_document_to_the_block_and_keeps_documents_whole(tmp_path):
    data = language_modeling(10)
    trainer = make_trainer(tmp_path, data, packing=True, max_length=32)
    tok = tiny_tokenizer()
    texts = []
    for row in trainer.train_dataset:
        batch = trainer.data_collator([row])
        doc, ids = batch["document_ids"][0], batch["input_ids"][0]
        assert ids.shape[0] <= 32 and ids.shape[0] % BLOCK == 0
        assert (doc.view(-1, BLOCK) == doc.view(-1, BLOCK)[:, :1]).all()  # constant inside each block
        for d in doc.unique().tolist():
            part = doc == d
            real = part & batch["attention_mask"][0].bool()
            if real.any():
                texts.append(tok.decode(ids[real]))
            # pads (alignment or row tail) are never supervised
            assert not (batch["completion_mask"][0].bool() & part & ~batch["attention_mask"][0].bool()).any()
    assert sorted(texts) == sorted(row["text"] + " </s>" for row in data)  # TRL appends EOS
    assert trainer.data_report["train"]["packed_rows"] == len(trainer.train_dataset) < 10


def test_a_packed_document_is_computed_as_if_it_were_alone(tmp_path):
    # Per-document attention and per-document RoPE positions: each document's hidden states in a packed row equal
    # those of the document run by itself (its block-aligned span), in both streams.
    trainer = make_trainer(tmp_path, language_modeling(6), packing=True, max_length=32)
    model = trainer.model.eval()
    batch = trainer.data_collator([trainer.train_dataset[0]])
    ids, doc = batch["input_ids"], batch["document_ids"]
    length = ids.shape[1]
    with torch.no_grad():
        packed = model(input_ids=ids, clean_input_ids=ids, document_ids=doc, return_logits=False).hidden_states
        assert len(doc[0].unique()) >= 2  # at least two documents (and a padding tail when the row is not full)
        for d in doc[0].unique().tolist():
            span = (doc[0] == d).nonzero().flatten()
            alone_ids = ids[:, span]
            alone = model(input_ids=alone_ids, clean_input_ids=alone_ids, return_logits=False).hidden_states
            n = span.numel()
            torch.testing.assert_close(packed[:, span], alone[:, :n], rtol=1e-5, atol=1e-5)  # noisy stream
            torch.testing.assert_close(packed[:, length + span], alone[:, n:], rtol=1e-5, atol=1e-5)  # clean


# --- the length policy ---------------------------------------------------------------------------
def test_overlong_samples_stop_before_training_and_say_how_many(tmp_path):
    data = prompt_completion(6, long_every=3)  # samples 0 and 3 are ~60 tokens
    with pytest.raises(ValueError, match=r"2 of 6 samples of the train dataset are longer than max_length=32.*"
                                         r"Nothing was truncated.*overlong_samples='truncate'"):
        make_trainer(tmp_path, data, max_length=32)


def test_truncation_only_when_configured_and_reported(tmp_path):
    data = prompt_completion(6, long_every=3)
    trainer = make_trainer(tmp_path, data, max_length=32, overlong_samples="truncate")
    report = trainer.data_report["train"]
    assert report["truncated_samples"] == 2 and report["truncated_tokens"] > 0
    # The two truncated samples lost their completions: nothing supervised is left, so they are dropped and counted.
    assert report["dropped_unsupervised"] == 2 and len(trainer.train_dataset) == 4
    assert max(len(r["input_ids"]) for r in trainer.train_dataset) <= 32


def test_overlong_samples_can_be_dropped(tmp_path):
    trainer = make_trainer(tmp_path, prompt_completion(6, long_every=3), max_length=32, overlong_samples="drop")
    assert trainer.data_report["train"]["dropped_overlong"] == 2 and len(trainer.train_dataset) == 4


# --- the group-shared sampler --------------------------------------------------------------------
def test_ranks_of_a_group_share_batches_and_replicas_partition_the_epoch():
    samplers = [BlockParallelBatchSampler(11, 2, num_replicas=3, replica=r, seed=5) for r in range(3)]
    twin = BlockParallelBatchSampler(11, 2, num_replicas=3, replica=1, seed=5)
    assert list(twin) == list(samplers[1])  # another rank of replica 1's group
    epochs = [list(s) for s in samplers]
    assert len({len(e) for e in epochs}) == 1  # every replica takes the same number of steps
    flat = [i for e in epochs for batch in e for i in batch]
    assert sorted(flat) == list(range(11))  # each sample exactly once
    assert [len(b) for b in epochs[2]] == [2, 1]  # the last global batch of 5 is shared 2 / 2 / 1


def test_sampler_order_changes_with_the_epoch_and_can_drop_the_last_batch():
    s = BlockParallelBatchSampler(8, 2, num_replicas=2, replica=0, seed=0)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first
    assert len(BlockParallelBatchSampler(9, 2, num_replicas=2, replica=0, drop_last=True)) == 2


# --- bad input: each a clear error, before anything is done --------------------------------------------------
@pytest.mark.parametrize(
    "dataset, kwargs, message",
    [
        (datasets.Dataset.from_dict({"question": ["a"], "answer": ["b"]}), {},
         r"columns \['answer', 'question'\], which match no SFT format"),
        (datasets.Dataset.from_dict({"prompt": ["what is"]}), {}, "has a 'prompt' column but no 'completion'"),
        (datasets.Dataset.from_dict({"completion": ["yes"]}), {}, "has a 'completion' column but no 'prompt'"),
        (language_modeling(2), dict(completion_only_loss=True), "completion_only_loss=True needs a prompt-completion"),
        (language_modeling(2), dict(assistant_only_loss=True), "assistant_only_loss=True needs a conversational"),
        (datasets.Dataset.from_dict({"text": []}), {}, "the train dataset is empty"),
    ],
    ids=["no_format", "prompt_only", "completion_only", "completion_loss_on_text", "assistant_loss_on_text", "empty"],
)
def test_dataset_without_the_fields_its_format_needs(tmp_path, dataset, kwargs, message):
    columns = list(dataset.column_names)
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, dataset, **kwargs)
    assert dataset.column_names == columns  # the user's dataset is untouched
    assert not (tmp_path / "out").exists()  # nothing written


def test_streaming_datasets_are_refused_with_the_reason(tmp_path):
    stream = datasets.Dataset.from_dict({"text": ["a b"]}).to_iterable_dataset()
    with pytest.raises(NotImplementedError, match="map-style datasets.Dataset"):
        make_trainer(tmp_path, stream)


def test_a_lora_target_that_matches_no_module(tmp_path):
    from peft import LoraConfig

    model = tiny_bdlm(block_size=BLOCK)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"target_modules=\['qkv'\] match no module.*\['down_proj', 'gate_proj', "
                                         r"'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"):
        make_trainer(tmp_path, prompt_completion(4), model=model, peft_config=LoraConfig(target_modules=["qkv"]))
    with pytest.raises(ValueError, match="target_modules is not set"):
        make_trainer(tmp_path, prompt_completion(4), model=model, peft_config=LoraConfig())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the model is not modified
    assert not (tmp_path / "out").exists()
