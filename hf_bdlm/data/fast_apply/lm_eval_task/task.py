"""The functions ``fast_apply.yaml`` names (lm-eval loads this file beside the YAML as the module ``task``)."""

from __future__ import annotations

from hf_bdlm.data.fast_apply import load_fast_apply
from hf_bdlm.data.fast_apply.scoring import ast_equal, exact_match


def load(**_metadata):
    """The held-out split as lm-eval's ``test`` split (a ``DatasetDict``; lm-eval passes its metadata, unused)."""
    import datasets  # lazy: lm-eval imports this file only when it builds the task

    records = load_fast_apply("heldout")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(
        [dict(prompt=r["prompt"][0]["content"], answer=r["answer"], module=r["module"], edit=r["edit"])
         for r in records])})


def doc_to_text(doc: dict) -> str:
    """The user message the recipes train on (one turn; lm-eval's --apply_chat_template wraps it as a user turn)."""
    return doc["prompt"]


def process_results(doc: dict, results: list[str]) -> dict:
    """Both of the task's rules on the one generated reply."""
    reply = results[0]
    return {"exact_match": float(exact_match(reply, doc["answer"])),
            "ast_match": float(ast_equal(reply, doc["answer"]))}
