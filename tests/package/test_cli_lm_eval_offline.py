"""`hf-bdlm lm-eval` on a hub task whose dataset cannot be downloaded (no network, not in the datasets cache): one
clear error naming the task and its dataset and what to do instead, exit code 2, no traceback; the error `datasets`
raised stays chained. Offline, `datasets` raises the builtin ConnectionError ("Couldn't reach ... on the Hub"); the
loader is replaced by one raising it, so the test needs no network either way.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval", reason="needs lm-eval (dev / lmeval extra)")

from hf_bdlm.cli import TaskDataUnavailable, _lm_eval_task_of, build_parser, main, run_lm_eval  # noqa: E402

ARGV = ["lm-eval", "--model", "dummy", "--tasks", "arc_easy"]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """``datasets.load_dataset`` fails as it does offline without a cached copy; the errors it raised."""
    import datasets

    raised = []

    def load_dataset(path, *args, **kwargs):
        raised.append(ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)"))
        raise raised[-1]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.chdir(tmp_path)
    return raised


def test_an_uncached_hub_dataset_is_one_clear_error(offline, capsys):
    assert main(ARGV) == 2
    err = capsys.readouterr().err
    message = err.strip().splitlines()[-1]
    assert message.startswith("error: lm-eval task 'arc_easy' needs the dataset 'allenai/ai2_arc', which could not be "
                              "downloaded")
    for what in ("no network access", "HF_DATASETS_OFFLINE", "datasets cache", "dataset_path is a local folder",
                 "--include_path", "tests/data/lm_eval_tasks", "bdlm_count_mc",
                 "ConnectionError: Couldn't reach 'allenai/ai2_arc' on the Hub"):
        assert what in message, what
    assert "Traceback" not in err


def test_the_error_datasets_raised_stays_chained(offline):
    args, extra = build_parser().parse_known_args(ARGV)
    with pytest.raises(TaskDataUnavailable) as raised:
        run_lm_eval(args, extra)
    assert raised.value.__cause__ is offline[-1]
    assert isinstance(raised.value, ConnectionError)  # callers catching the old error still catch it


def test_a_connection_error_outside_a_task_is_left_as_it_is():
    try:
        raise ConnectionError("the server went away")
    except ConnectionError as err:
        assert _lm_eval_task_of(err) is None
