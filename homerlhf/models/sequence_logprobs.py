"""Log-probs of given token sequences under a causal LM (held-out passes, export checks), without its
full logits.

``model(ids).logits`` is (rows, width, vocabulary): for a 152k-row head, 16 rows of 1,024 tokens are
9.3 GiB in bf16 and as much again for each fp32 copy a log-softmax reads or writes. Here the decoder
runs alone for its final hidden states, the positions asked for are gathered, and the LM head and the
log-softmax run over ``chunk_tokens`` of them at a time (:func:`token_logprobs`): the (chunk, V) fp32
logits and one temporary of their size are the only full-vocabulary tensors. The logits are the
model's own: its post-processing of the head's output (:func:`output_logit_transform`) applies, and a
16-bit ``nn.Linear`` head gives fp32 logits without an fp32 copy of itself (:func:`fp32_logits`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from homerlhf.models.lm_head import Fp32LogitsLinear, fp32_logits
from homerlhf.models.logprobs import LogitTransform, output_logit_transform


def lm_parts(model) -> tuple[nn.Module, nn.Module, Optional[LogitTransform]]:
    """``(decoder, LM head, logit transform)`` of a causal LM or of a peft model on one (LoRA injected in
    place, so the active adapter is the one that runs)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(inner, inner.base_model_prefix), inner.get_output_embeddings(), output_logit_transform(inner.config)


def head_logits(head: nn.Module, hidden: Tensor, transform: Optional[LogitTransform] = None) -> Tensor:
    """fp32 logits (N, V) of ``head`` on ``hidden`` (N, H), post-processed by ``transform``."""
    if type(head) in (nn.Linear, Fp32LogitsLinear):
        logits = fp32_logits(hidden, head.weight, head.bias)
    else:  # a head of another kind (a LoRA on the head): its own forward
        logits = head(hidden).float()
    return logits if transform is None else transform(logits)


def token_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, chunk_tokens: int,
                   transform: Optional[LogitTransform] = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """``log_softmax(transform(head(hidden)))[i, targets[i]]`` for N positions, ``chunk_tokens`` at a time.

    hidden: (N, H); targets: (N,) long. Returns (N,) in ``dtype`` (fp32, or fp64 for an exact comparison).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        logits = head_logits(head, hidden[start:start + chunk_tokens], transform).to(dtype)  # (c, V)
        taken = logits.gather(-1, targets[start:start + chunk_tokens, None]).squeeze(-1)
        out[start:start + chunk_tokens] = taken - torch.logsumexp(logits, dim=-1)  # one (c, V) temporary
        del logits
    return out


@torch.no_grad()
def answer_logprobs(model, sequences: Sequence[Sequence[int]], starts: Sequence[int], pad_id: int,
                    chunk_tokens: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    """Per sequence ``i``, ``log p(seq[t] | seq[:t])`` for ``starts[i] <= t < len(seq)`` (``starts[i] >= 1``):
    one forward of the decoder over the batch (right-padded with ``pad_id``), then the LM head over those
    positions only, ``chunk_tokens`` at a time. Returns one CPU tensor per sequence, in ``dtype``."""
    if any(not 1 <= s <= len(seq) for s, seq in zip(starts, sequences)):
        raise ValueError("every start must be in [1, len(sequence)]: the first token has no prediction")
    decoder, head, transform = lm_parts(model)
    device = next(model.parameters()).device
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows, cols = [], []
    for i, (seq, start) in enumerate(zip(sequences, starts)):
        ids[i, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[i, :len(seq)] = 1
        rows.append(torch.full((len(seq) - start,), i, dtype=torch.long))
        cols.append(torch.arange(start - 1, len(seq) - 1))  # position t - 1 predicts token t
    ids, mask = ids.to(device), mask.to(device)
    rows, cols = torch.cat(rows).to(device), torch.cat(cols).to(device)
    hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # (B, W, H)
    picked = hidden[rows, cols]  # (N, H): the answers' positions only
    del hidden
    logp = token_logprobs(head, picked, ids[rows, cols + 1], chunk_tokens, transform, dtype).cpu()
    return list(torch.split(logp, [len(seq) - start for seq, start in zip(sequences, starts)]))
