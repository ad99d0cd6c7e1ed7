"""Reward scores of an HF ``*ForSequenceClassification`` (num_labels 1), pooled by one rule.

The score of a sequence is the score head applied to the hidden state at the **last position
where the attention mask is 1**. HF's own forward pools at "the last token that is not the pad
id", which is the wrong token whenever the pad id is also a real token of the sequence: with
Llama-3's pad = eos (``<|eot_id|>``) it reads the token before the final end-of-turn. Every path
that scores with an HF reward model goes through :func:`sequence_scores`: the reward stage's
training loss and evaluation, the ``hf`` reward backend and the app's Evaluate tab (through that
backend). The ``adapter`` reward backend (:mod:`homerlhf.models.reward_adapter`) pools with
:func:`pooled_hidden` on the policy's backbone. The llama.cpp worker pools the same position: it
gets unpadded sequences and reads their last token.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from homerlhf.models.logprobs import position_ids_from_mask


def last_real_index(attention_mask: Tensor) -> Tensor:
    """attention_mask (B, L), 1 on real tokens, any padding side -> (B,) long: the last column
    holding a 1 in each row."""
    width = attention_mask.shape[-1]
    return width - 1 - attention_mask.long().flip(-1).argmax(-1)


def pooled_hidden(backbone, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The backbone's final hidden state (B, H) at :func:`last_real_index` of each row.

    ``backbone``: the decoder under the LM or score head (``model.model`` of a Llama), any
    adapters it carries active as they are. input_ids, attention_mask: (B, L), either padding side.
    """
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, last_real_index(attention_mask).to(hidden.device)]  # (B, H)


def sequence_scores(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Scores (B,) of a sequence classifier at :func:`last_real_index`.

    ``model``: an HF ``*ForSequenceClassification`` or a peft model wrapping one (its LoRA layers
    sit inside the backbone, its score head is the wrapped ``score``). input_ids, attention_mask:
    (B, L), either padding side. Gradients flow when the caller enables them.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(inner, inner.base_model_prefix)
    return inner.score(pooled_hidden(backbone, input_ids, attention_mask)).squeeze(-1)


def padded_batches(sequences: Sequence[Sequence[int]], pad_id: int, batch_size: int, device):
    """Unpadded token sequences as right-padded ``(input_ids, attention_mask)`` (b, L) batches."""
    from torch.nn.utils.rnn import pad_sequence

    for start in range(0, len(sequences), batch_size):
        rows = [torch.as_tensor(list(s), dtype=torch.long, device="cpu") for s in sequences[start:start + batch_size]]
        ids = pad_sequence(rows, batch_first=True, padding_value=pad_id).to(device)
        mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True).to(device)
        yield ids, mask


@torch.no_grad()
def score_sequences(model, sequences: Sequence[Sequence[int]], pad_id: int, batch_size: int = 32) -> Tensor:
    """Scores (n,) float32 on the CPU of unpadded token sequences, ``batch_size`` at a time."""
    device = next(model.parameters()).device
    scores = [sequence_scores(model, ids, mask).float().cpu()
              for ids, mask in padded_batches(sequences, pad_id, batch_size, device)]
    return torch.cat(scores) if scores else torch.zeros(0)
