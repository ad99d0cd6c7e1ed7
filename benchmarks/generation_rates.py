"""The measurements of ``benchmarks/gpu_generation.py``: one generation call timed, the decode rate of
a decoder from two lengths (after an untimed warm-up at the longer), K/V repeats counted by where
they ran, HF generate and the loop interleaved, and the two samplers' agreement."""

from __future__ import annotations

import time


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generation(policy, rollout, prompts, seeds) -> tuple[float, float, int, object]:
    """Wall seconds, this process's CPU seconds (all threads: on a shared CPU steadier than the wall
    clock), generated tokens and the batch of one ``generate_rollout`` call."""
    from homerlhf.ppo.rollout import generate_rollout

    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    batch = generate_rollout(policy, prompts, rollout, seeds=seeds)
    sync()
    return time.perf_counter() - t0, time.process_time() - c0, int(batch.response_mask.sum()), batch


class KVRepeats:
    """Counts the layer passes in which HF's sdpa repeated K and V to every query head (its
    ``repeat_kv``, once for K and once for V) while active, split by the query's length: a decode
    step's one token, or a prefill's block. A pre-hook on each GQA attention module notes the length
    of the query it is about to attend (its ``hidden_states``), so each repeat is put where it ran.

    Decode steps: 0 for both decoders on unpadded prompts (HF: no mask, sdpa's GQA kernel; the loop:
    query groups folded). A prefill block over ``rollout.prefill_tokens`` runs in column pieces
    (``RolloutConfig.prefill_columns``), and every piece after the first attends with a mask, which
    makes HF's sdpa repeat K/V there, in both decoders alike: (pieces - 1) x layers a call, e.g. 16
    rows x 512 tokens in pieces of 256 columns: 1 x 28 for a 28-layer model, 32 rows in pieces of 128:
    3 x 28 = 84. It is part of the fixed cost of a call, which the per-step rate leaves out."""

    def __init__(self, model=None):
        self.calls = {"decode": 0, "prefill": 0}
        self.model = model
        self._query_len = 0
        self._hooks = []

    @property
    def layer_passes(self) -> int:
        return self.decode_layer_passes + self.prefill_layer_passes

    @property
    def decode_layer_passes(self) -> int:
        return self.calls["decode"] // 2

    @property
    def prefill_layer_passes(self) -> int:
        return self.calls["prefill"] // 2

    def _note(self, module, args, kwargs) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        self._query_len = hidden.shape[1] if hidden is not None and hidden.dim() == 3 else 0

    def __enter__(self):
        import transformers.integrations.sdpa_attention as sdpa

        self.module, self.original = sdpa, sdpa.repeat_kv
        for module in (self.model.modules() if self.model is not None else ()):
            if getattr(module, "num_key_value_groups", 1) > 1:
                self._hooks.append(module.register_forward_pre_hook(self._note, with_kwargs=True))

        def counted(hidden_states, n_rep):
            if n_rep > 1:
                self.calls["decode" if self._query_len == 1 else "prefill"] += 1
            return self.original(hidden_states, n_rep)

        sdpa.repeat_kv = counted
        return self

    def __exit__(self, *exc):
        self.module.repeat_kv = self.original
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def rate(policy, cfg, decoder: str, rows: int, prompts, measure_tokens: int, warmup: bool = True) -> dict:
    """Seconds per decode step and per call of ``decoder`` at ``rows`` rows, from two lengths (a
    quarter of ``measure_tokens``, and ``measure_tokens``), after an untimed warm-up call: for the loop
    at the longer length, so that its session (its cache and captured step) is built there for the
    longest cache and every timed call replays it (HF generate keeps nothing between calls: 2 tokens) (``sessions_built`` in the timed calls: 0; ``captured_replays``: the
    timed calls' replays, 0 when eager). And in how many layer passes of the longer call K/V were
    repeated to every query head (:class:`KVRepeats`): decode steps and prefill apart."""
    short_tokens = max(2, measure_tokens // 4)
    decoder_state = policy.static_decoder
    seconds, cpu, counted = {}, {}, {}
    warm = (measure_tokens if decoder == "static" else 2,) if warmup else ()
    for i, tokens in enumerate(warm + (short_tokens, measure_tokens)):  # the warm-up's not counted
        if i == len(warm):
            counted = {"sessions": decoder_state.sessions_made, "replays": decoder_state.replays}
        rollout = cfg.rollout.model_copy(update={"decoder": decoder, "max_new_tokens": tokens,
                                                 "chunk_size": rows})
        with KVRepeats(policy.model) as repeats:
            seconds[tokens], cpu[tokens], generated, _ = timed_generation(policy, rollout, prompts[:rows],
                                                                          list(range(rows)))
    per_step = (seconds[measure_tokens] - seconds[short_tokens]) / (measure_tokens - short_tokens)
    cpu_per_step = (cpu[measure_tokens] - cpu[short_tokens]) / (measure_tokens - short_tokens)
    return {"decoder": decoder, "rows": rows, "tokens": measure_tokens, "seconds": round(seconds[measure_tokens], 4),
            "seconds_per_step": round(per_step, 6), "fixed_seconds": round(seconds[measure_tokens] - per_step * measure_tokens, 4),
            "tokens_per_s": round(rows / per_step, 1) if per_step > 0 else None,
            "cpu_seconds_per_step": round(cpu_per_step, 6), "generated_tokens": generated,
            "kv_repeated_layer_passes": repeats.layer_passes,
            "kv_repeated_decode_layer_passes": repeats.decode_layer_passes,
            "kv_repeated_prefill_layer_passes": repeats.prefill_layer_passes,
            "sessions_built": decoder_state.sessions_made - counted["sessions"],
            "captured_replays": decoder_state.replays - counted["replays"]}


def interleaved(policy, cfg, prompts, rows: int, tokens: int, rounds: int) -> dict:
    """HF generate and the loop alternately (the order swapped each round, after one warm-up round):
    median wall and CPU seconds of each, and whether every round's samples were equal."""
    import statistics

    import torch

    times = {"hf": [], "static": []}
    equal = True
    for r in range(rounds + 1):
        batches = {}
        for decoder in ("hf", "static") if r % 2 == 0 else ("static", "hf"):
            rollout = cfg.rollout.model_copy(update={"decoder": decoder, "max_new_tokens": tokens, "chunk_size": rows})
            wall, cpu, _, batches[decoder] = timed_generation(policy, rollout, prompts[:rows], list(range(rows)))
            if r:
                times[decoder].append((wall, cpu))
        equal = equal and torch.equal(batches["hf"].response_ids, batches["static"].response_ids)
    out = {f"{d}_{k}": round(statistics.median(t[i] for t in v), 4)
           for d, v in times.items() for i, k in enumerate(("wall_s", "cpu_s"))}
    return {"rows": rows, "tokens": tokens, "rounds": rounds, **out, "samples_equal": equal,
            "static_vs_hf_wall": round(out["hf_wall_s"] / out["static_wall_s"], 3),
            "static_vs_hf_cpu": round(out["hf_cpu_s"] / out["static_cpu_s"], 3)}


def agreement(policy, cfg, prompts, rows: int, tokens: int) -> dict:
    """HF generate vs the loop on the same prompts and seeds, and the loop vs the trainer's old log-probs."""
    import torch

    from homerlhf.ppo.collect import score_with_policy
    from homerlhf.ppo.importance import importance_metrics, truncated_importance_weights

    batches = {}
    for decoder in ("hf", "static"):
        rollout = cfg.rollout.model_copy(update={"decoder": decoder, "max_new_tokens": tokens, "chunk_size": rows})
        batches[decoder] = timed_generation(policy, rollout, prompts[:rows], list(range(1000, 1000 + rows)))[3]
    hf, static = batches["hf"], batches["static"]
    width = min(hf.response_ids.shape[1], static.response_ids.shape[1])
    same = (hf.response_ids[:, :width] == static.response_ids[:, :width]).long()
    prefix = same.cumprod(dim=1).sum(dim=1)  # tokens equal before the first difference, per row
    on_prefix = torch.arange(width, device=prefix.device)[None, :] < prefix[:, None]
    gap = ((hf.behaviour_logprobs[:, :width] - static.behaviour_logprobs[:, :width]).abs() * on_prefix).max()
    old = score_with_policy(policy, static)[0]
    mask = static.response_mask.to(old.device)
    behaviour = static.behaviour_logprobs.to(old.device)
    weights = truncated_importance_weights(old, behaviour, mask, cfg.rollout.is_cap)
    stats = {k: float(v) for k, v in importance_metrics(old, behaviour, weights, mask).items()}
    return {"rows": rows, "tokens": tokens, "rows_all_equal": int((prefix == width).sum()),
            "mean_common_prefix": round(float(prefix.float().mean()), 2), "common_prefix": prefix.tolist(),
            "max_behaviour_gap_on_prefix": float(gap),
            "max_behaviour_vs_old": float(((behaviour - old).abs() * mask).max()), **stats}


