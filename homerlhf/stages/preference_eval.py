"""What a DPO / KTO run did to the held-out rows: each answer's log-probability under the trained
policy and under the reference (the policy it started from), on the same base in one model.

- pairs: the margin ``log p(chosen) - log p(rejected)`` (summed over the answer's tokens) before
  (the reference) and after (the trained policy), and the fraction of pairs whose margin is > 0;
- rated answers: the mean of ``log p_after(y) - log p_before(y)`` over the good answers and over the
  bad ones (KTO should raise the first and lower the second).

Both on the held-out rows and (:func:`trained_figures`) on the rows it trained on.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def reference_context(model):
    """The reference, switched on in the trained peft model for the block: TRL's ``ref`` adapter (a
    copy of the adapter the run started from) when there is one, else the base with adapters off."""
    from trl.trainer.utils import use_adapter

    return use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None)


@torch.no_grad()
def completion_logprobs(model, rows: Sequence[dict[str, Any]], key: str, pad_id: int,
                        batch_size: int = 16) -> list[float]:
    """Sum of the log-probs of ``row[key]`` (answer ids) after ``row["prompt_ids"]``, per row."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[float] = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        seqs = [list(r["prompt_ids"]) + list(r[key]) for r in batch]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s, device=device)
            mask[i, :len(s)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        for i, r in enumerate(batch):
            first = len(r["prompt_ids"]) - 1  # the position that predicts the answer's first token
            out.append(float(logp[i, first:first + len(r[key])].sum()))
    model.train(was_training)
    return out


def _both(model, rows, key: str, pad_id: int) -> tuple[list[float], list[float]]:
    """(reference, trained) log-probs of ``rows``' answers under ``key``."""
    with reference_context(model):
        before = completion_logprobs(model, rows, key, pad_id)
    return before, completion_logprobs(model, rows, key, pad_id)


def pair_margins(model, pairs: Sequence[dict], pad_id: int) -> dict[str, Any]:
    """Held-out pair figures before (reference) and after (trained): mean margin and accuracy."""
    if not pairs:
        return {}
    chosen_before, chosen_after = _both(model, pairs, "chosen_ids", pad_id)
    rejected_before, rejected_after = _both(model, pairs, "rejected_ids", pad_id)
    before = [c - r for c, r in zip(chosen_before, rejected_before)]
    after = [c - r for c, r in zip(chosen_after, rejected_after)]
    n = len(pairs)
    return {"eval_pairs": n, "margin_before": sum(before) / n, "margin_after": sum(after) / n,
            "accuracy_before": sum(m > 0 for m in before) / n, "accuracy_after": sum(m > 0 for m in after) / n,
            "chosen_logp_change": sum(a - b for a, b in zip(chosen_after, chosen_before)) / n,
            "rejected_logp_change": sum(a - b for a, b in zip(rejected_after, rejected_before)) / n}


def rated_changes(model, rated: Sequence[dict], pad_id: int) -> dict[str, Any]:
    """Held-out rated answers: mean log-prob change (after - before) of the good and of the bad ones."""
    if not rated:
        return {}
    before, after = _both(model, rated, "completion_ids", pad_id)
    result: dict[str, Any] = {"eval_rated": len(rated)}
    for name, label in (("good", True), ("bad", False)):
        changes = [a - b for a, b, r in zip(after, before, rated) if r["label"] is label]
        result[f"{name}_logp_change"] = sum(changes) / len(changes) if changes else None
    return result


TRAINED_ROWS = 256  # the training rows measured at the end (the first ones, in training order): a bounded pass


def trained_figures(model, data, pad_id: int) -> dict[str, Any]:
    """The same figures on (the first :data:`TRAINED_ROWS` of) the rows it trained on: pairs for DPO, rated
    answers for KTO. What the run did to the data it saw, beside what it did to the held-out rows."""
    rows = data.train[:TRAINED_ROWS]
    return pair_margins(model, rows, pad_id) if data.method == "dpo" else rated_changes(model, rows, pad_id)


def held_out_figures(model, data, pad_id: int) -> dict[str, Any]:
    """:func:`pair_margins` on the held-out pairs and, for KTO, :func:`rated_changes` on the rated answers."""
    figures = pair_margins(model, data.eval_pairs, pad_id)
    if data.method == "kto":
        figures.update(rated_changes(model, data.eval_rated, pad_id))
    return figures
