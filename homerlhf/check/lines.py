"""The line ``homerlhf check`` prints per case: ``ok`` with its figures, or ``FAIL`` and the error."""

from __future__ import annotations


def plan_words(entry: dict) -> str:
    """Which plan the measured peaks were compared with, in a few words: e.g. "first iteration, static"."""
    assumed = entry.get("plan_assumptions") or {}
    rollout = assumed.get("generation")
    if not rollout:
        return ""
    if not rollout["after_first_step"]:
        when = "first iteration"
    elif not rollout["held_gradients"]:
        when = "after a resume"
    else:
        when = "steady state"
    return f"plan: {when}, {rollout['decoder']} decoder, {rollout['cublas_workspaces']} cuBLAS workspaces"


def kernel_words(entry: dict) -> str:
    settings = entry.get("kernel_settings")
    if not settings:
        return "kernel settings not recorded"
    backends = settings.get("sdpa_backends")
    backends = ", ".join(backends) if isinstance(backends, (list, tuple)) else backends
    return f"attention {backends or 'default'}, TF32 {'on' if settings.get('tf32') else 'off'}"


def checkpointing_words(entry: dict) -> str:
    """Which layers recomputed in backward and were offloaded, per model: e.g. "recomputed policy 14/28,
    offloaded 14; critic 24/24"."""
    models = entry.get("activation_checkpointing")
    if not models:
        return ""
    words = [f"{name} {len(m['recomputed'])}/{m['layers']}" + (f", offloaded {len(m['offloaded'])}" if m["offloaded"] else "")
             for name, m in models.items()]
    return "recomputed " + "; ".join(words)


def gap_words(entry: dict) -> str:
    gap = entry.get("sampled_vs_scored")
    if not gap or gap.get("max_abs") is None:
        return "sampled vs scored: not measured" + (" (a subprocess)" if entry.get("kind") == "cli" else "")
    return f"sampled vs scored log-probs: max {gap['max_abs']:.2e}, mean {gap['mean_abs']:.2e} ({gap['tokens']} tokens)"


def preference_words(entry: dict) -> list[str]:
    """A preference case's figures: its phases against the plan, steps, seconds, TRL's first logged step
    (a policy equal to its reference) and the held-out figures."""
    from homerlhf.check.preference_case import start_loss

    phases = ", ".join(f"{phase} {c['predicted_gib']:.2f}/{c['measured_gib']:.2f} ({c['error']:+.1%}"
                       + (f", plan's {c['plan_phase']})" if c["plan_phase"] != phase else ")")
                       for phase, c in entry["comparison"].items())
    unit = "GiB" if entry.get("max_reserved_gib") is not None else "GiB (CPU RSS)"
    s, first, held = entry["seconds"], entry["first_step"], entry["held_out"]
    parts = [f"{unit} planned/measured: {phases}"]
    if entry.get("max_reserved_gib") is not None:
        parts.append(f"reserved {entry['max_reserved_gib']:.2f}")
    rate = entry["tokens_per_s"]["training"]
    parts.append(f"s training {s['training']:.1f}" + (f" ({rate:,.0f} tokens/s)" if rate else "")
                 + f", held-out pass {s['held-out pass']:.1f}")
    parts.append(f"optimizer steps {entry['optimizer_steps']['taken']} taken ({entry['batch_size']} rows x "
                 f"{entry['grad_accum']} accumulated, up to {entry['max_len']} tokens)")
    if "loss" in first:
        parts.append(f"first step loss {first['loss']:.4f} (a policy equal to its reference: "
                     f"{start_loss(entry['kind']):.4f})")
    if "margin_before" in held:
        parts.append(f"held-out margin {held['margin_before']:+.3f} -> {held['margin_after']:+.3f} on "
                     f"{held['eval_pairs']} pairs")
    if held.get("good_logp_change") is not None:
        parts.append(f"good answers {held['good_logp_change']:+.3f}, bad {held['bad_logp_change']:+.3f} nats")
    return parts


def line(entry: dict) -> str:
    name = f"{entry['case']:<20} {entry['wall_s']:6.1f} s" + (f" (est. {entry['estimate_s']} s)"
                                                             if "estimate_s" in entry else "")
    if "error" in entry:
        return f"FAIL {name}  {entry['error']}"
    if entry["kind"] in ("dpo", "kto"):
        return f"ok   {name}  " + "; ".join(preference_words(entry))
    unit = "GiB" if entry.get("max_reserved_gib") is not None or entry["kind"] == "cli" else "GiB (CPU RSS)"
    phases = ", ".join(f"{phase} {c['predicted_gib']:.2f}/{c['measured_gib']:.2f} ({c['error']:+.1%})"
                       for phase, c in entry["comparison"].items())
    s = entry["seconds"]
    parts = [f"{unit} planned/measured: {phases}", plan_words(entry)]
    if entry.get("max_reserved_gib") is not None:
        parts.append(f"reserved {entry['max_reserved_gib']:.2f}")
    parts.append(f"s/iteration {s['time_iteration_s']:.1f} (generation {s['time_generation_s']:.1f}, "
                 f"scoring {s['time_scoring_s']:.1f}, update {s['time_update_s']:.1f})")
    decoder = entry.get("decoder")
    if decoder and entry.get("captured_replays"):
        decoder += f", {entry['captured_replays']} replays"
    parts.append(f"{entry['tokens_per_s'].get('tokens_per_s_generation', 0):.0f} tokens/s generated"
                 + (f" ({decoder})" if decoder else ""))
    parts += [kernel_words(entry), checkpointing_words(entry), gap_words(entry)]
    steps = entry["optimizer_steps"]
    parts.append(f"optimizer steps {steps['taken']} taken, {steps['skipped']} skipped"
                 + (f" (loss scale {steps['loss_scale']:g})" if steps.get("loss_scale") is not None else ""))
    if entry.get("placement"):
        parts.append(entry["placement"][0].removeprefix("[homerlhf] "))
    if entry["kind"] == "resume":
        parts.append(f"resumed from {entry['resumed_from']}: state equal ({entry['state_entries']} entries)")
    if entry["kind"] == "cli":
        parts.append(f"train + train --resume: {', '.join(entry['checkpoints'])}")
    return f"ok   {name}  " + "; ".join(p for p in parts if p)
