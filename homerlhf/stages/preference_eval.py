"""What a DPO / KTO run did to the held-out rows: each answer's log-probability under the trained
policy and under the reference (the policy it started from), on the same base in one model.

- pairs: the margin ``log p(chosen) - log p(rejected)`` (summed over the answer's tokens) before
  (the reference) and after (the trained policy), and the fraction of pairs whose margin is > 0;
- rated answers: the mean of ``log p_after(y) - log p_before(y)`` over the good answers and over the
  bad ones (KTO should raise the first and lower the second).

The pass never builds the full logits (:mod:`homerlhf.models.sequence_logprobs`), takes the rows and the
chunk its plan counts (:func:`homerlhf.memory.preference.held_out_batch`) and backs off out of memory.

Both on the held-out rows and (:func:`trained_figures`) on the rows it trained on.
"""

from __future__ import annotations

from typing import Any, Sequence

from homerlhf.errors import UserError


def reference_context(model):
    """The reference, switched on in the trained peft model for the block: TRL's ``ref`` adapter (a
    copy of the adapter the run started from) when there is one, else the base with adapters off."""
    from trl.trainer.utils import use_adapter

    return use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None)


def completion_logprobs(model, rows: Sequence[dict[str, Any]], key: str, pad_id: int, batch_size: int = 16,
                        chunk_per_row: int = 64, fix: str = "") -> list[float]:
    """Sum of the log-probs of ``row[key]`` (answer ids) after ``row["prompt_ids"]``, per row.

    ``batch_size`` rows per forward, the LM head over ``chunk_per_row`` answer positions per row at a time
    (:func:`homerlhf.models.sequence_logprobs.answer_logprobs`: never the full logits). Out of memory, the
    rows per forward (and with them the chunk) halve, and the pass goes on from the batch that failed
    (:func:`homerlhf.memory.oom.run_with_backoff`); still out of memory at one row, a one-line error
    naming ``fix`` (the settings that lower it)."""
    from homerlhf.memory.oom import OutOfMemoryAtMicroBatch1, maybe_raise, run_with_backoff
    from homerlhf.models.sequence_logprobs import answer_logprobs

    was_training = model.training
    model.eval()
    out: list[float] = []

    def rest(size: int) -> list[float]:  # the rows not done yet, ``size`` per forward
        while len(out) < len(rows):
            batch = rows[len(out):len(out) + size]
            maybe_raise(size)
            logps = answer_logprobs(model, [list(r["prompt_ids"]) + list(r[key]) for r in batch],
                                    [len(r["prompt_ids"]) for r in batch], pad_id, chunk_per_row * len(batch))
            out.extend(float(x.sum()) for x in logps)
        return out

    try:
        return run_with_backoff(rest, max(1, batch_size), phase="the held-out pass")
    except OutOfMemoryAtMicroBatch1 as exc:
        raise UserError(f"out of GPU memory in the held-out pass even with one row per forward "
                        f"({type(exc.__cause__).__name__}); {fix or 'use shorter held-out rows'}",
                        exit_code=1) from exc
    finally:
        model.train(was_training)


def _both(model, rows, key: str, pad_id: int, **batching) -> tuple[list[float], list[float]]:
    """(reference, trained) log-probs of ``rows``' answers under ``key``; ``batching``: how
    :func:`completion_logprobs` batches them."""
    with reference_context(model):
        before = completion_logprobs(model, rows, key, pad_id, **batching)
    return before, completion_logprobs(model, rows, key, pad_id, **batching)


def pair_margins(model, pairs: Sequence[dict], pad_id: int, **batching) -> dict[str, Any]:
    """Held-out pair figures before (reference) and after (trained): mean margin and accuracy."""
    if not pairs:
        return {}
    chosen_before, chosen_after = _both(model, pairs, "chosen_ids", pad_id, **batching)
    rejected_before, rejected_after = _both(model, pairs, "rejected_ids", pad_id, **batching)
    before = [c - r for c, r in zip(chosen_before, rejected_before)]
    after = [c - r for c, r in zip(chosen_after, rejected_after)]
    n = len(pairs)
    return {"eval_pairs": n, "margin_before": sum(before) / n, "margin_after": sum(after) / n,
            "accuracy_before": sum(m > 0 for m in before) / n, "accuracy_after": sum(m > 0 for m in after) / n,
            "chosen_logp_change": sum(a - b for a, b in zip(chosen_after, chosen_before)) / n,
            "rejected_logp_change": sum(a - b for a, b in zip(rejected_after, rejected_before)) / n}


def rated_changes(model, rated: Sequence[dict], pad_id: int, **batching) -> dict[str, Any]:
    """Held-out rated answers: mean log-prob change (after - before) of the good and of the bad ones."""
    if not rated:
        return {}
    before, after = _both(model, rated, "completion_ids", pad_id, **batching)
    result: dict[str, Any] = {"eval_rated": len(rated)}
    for name, label in (("good", True), ("bad", False)):
        changes = [a - b for a, b, r in zip(after, before, rated) if r["label"] is label]
        result[f"{name}_logp_change"] = sum(changes) / len(changes) if changes else None
    return result


TRAINED_ROWS = 256  # the training rows measured at the end (the first ones, in training order): a bounded pass


def _batching(cfg, method: str) -> dict[str, Any]:
    """How the end-of-run passes batch their rows: as the run's plan counts the held-out pass."""
    from homerlhf.memory.preference import held_out_batch

    rows, chunk = held_out_batch(cfg, method)
    return {"batch_size": rows, "chunk_per_row": chunk // rows,
            "fix": f"lower {method}.max_len or ppo.logprob_chunk_size, or hold out shorter rows"}


def trained_figures(model, data, pad_id: int, cfg) -> dict[str, Any]:
    """The same figures on (the first :data:`TRAINED_ROWS` of) the rows it trained on: pairs for DPO, rated
    answers for KTO. What the run did to the data it saw, beside what it did to the held-out rows."""
    rows, batching = data.train[:TRAINED_ROWS], _batching(cfg, data.method)
    return (pair_margins(model, rows, pad_id, **batching) if data.method == "dpo"
            else rated_changes(model, rows, pad_id, **batching))


def held_out_figures(model, data, pad_id: int, cfg) -> dict[str, Any]:
    """:func:`pair_margins` on the held-out pairs and, for KTO, :func:`rated_changes` on the rated answers,
    batched as the run's plan counts the pass (:func:`homerlhf.memory.preference.held_out_batch`)."""
    batching = _batching(cfg, data.method)
    figures = pair_margins(model, data.eval_pairs, pad_id, **batching)
    if data.method == "kto":
        figures.update(rated_changes(model, data.eval_rated, pad_id, **batching))
    return figures
