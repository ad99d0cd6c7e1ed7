"""`homerlhf export`: the reference and reward models for the llama.cpp workers, and a trained policy
for anyone (merged HF model, GGUF, the Hub). Parse, call, print: the work is in homerlhf.workers.gguf
and homerlhf.stages.export."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

export_app = typer.Typer(no_args_is_help=True, help="Export models: GGUF for the llama.cpp workers, a trained policy for anyone.")
ConfigOpt = typer.Option(None, "--config", "-c", help="A YAML file merged over the preset.")


@export_app.command("ref")
def export_ref(
    model: str = typer.Option(..., "--model", "-m", help="HF model dir or hub id."),
    out: Path = typer.Option(..., "--out", "-o", help="Output .gguf file."),
    outtype: Optional[str] = typer.Option(
        None, "--outtype", help="f32, f16, bf16 or q8_0 (default: ref.outtype of --preset/--config/--set, else f16)."),
    from_nf4: bool = typer.Option(False, "--from-nf4", help="Export the dequantized NF4 base (KL-consistent)."),
    preset: Optional[str] = typer.Option(
        None, "--preset", "-p", help="Quantize as `train` would with this preset: its quant:, card.device, ref.outtype."),
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = typer.Option([], "--set", "-s", help="Dotted override, as for train (repeatable)."),
) -> None:
    """Export a causal LM as the reference model GGUF."""
    from homerlhf.workers.gguf import export_ref as _export_ref

    quant, device, default_outtype = None, "cpu", "f16"
    if preset or config or set_:  # the trainer's own settings for this run config
        from homerlhf.config import load_config

        cfg = load_config(preset or "cpu-tiny", config, set_)
        quant, device, default_outtype = cfg.quant, cfg.card.device, cfg.ref.outtype
    path = _export_ref(model, out, outtype=outtype or default_outtype, from_nf4=from_nf4, quant=quant, device=device)
    typer.echo(f"wrote {path}")


@export_app.command("reward")
def export_reward(
    model: str = typer.Option(..., "--model", "-m", help="Sequence-classification dir or reward run dir."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory."),
    outtype: str = typer.Option("f16", "--outtype", help="f32, f16, bf16 or q8_0."),
) -> None:
    """Export a reward model: backbone GGUF + score head (safetensors) + manifest."""
    from homerlhf.workers.gguf import export_reward as _export_reward

    path = _export_reward(model, out, outtype=outtype)
    typer.echo(f"wrote {path}")


@export_app.command("policy")
def export_policy(
    run_dir: Path = typer.Argument(..., help="The run directory of `homerlhf train` (its --out)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (merged HF model, gguf/, README.md)."),
    checkpoint: str = typer.Option("last", "--checkpoint", help="Iteration number, last, or best (highest score_mean)."),
    base: str = typer.Option("nf4", "--base", help="nf4: merge into the dequantized NF4 weights the actor trained on "
                             "(the trained model); original: into the original weights (differs; the gap is measured)."),
    gguf: List[str] = typer.Option([], "--gguf", help="GGUF types too: f32, f16, bf16, q8_0, q6_k, q5_k_m, q4_k_m "
                                   "(repeatable or comma-separated; quantized by llama.cpp)."),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="Upload OUT to this Hub repo (token: HF_TOKEN or `hf auth login`)."),
    private: bool = typer.Option(False, "--private", help="Create the Hub repo private."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="fp32, bf16 or fp16 for the merged model (default: the dtype the policy computed in, "
        "fp32 for a CPU run; a lower one is smaller and the export says what its rounding costs)."),
) -> None:
    """Export a run's trained policy: a merged HF model, GGUFs with Ollama Modelfiles, a model card."""
    from homerlhf.stages.export import export_policy as _export_policy

    result = _export_policy(run_dir, out, checkpoint=checkpoint, base=base, gguf=gguf, push_to_hub=push_to_hub,
                            private=private, overwrite=overwrite, dtype=dtype)
    gap = result["gap"]
    typer.echo(f"wrote {result['out']} from {result['checkpoint']} (base {result['base']}, {result['dtype']}; "
               f"the policy computed in {result['compute_dtype']})")
    verdict = (f"the trained policy up to {result['dtype']} rounding" if result["base"] == "nf4" else
               "NOT the trained policy: merged into the original weights, not the NF4 ones it trained on")
    typer.echo(f"log-prob gap to the trained policy on {gap['tokens']} held tokens: max {gap['max_abs']:.2e}, "
               f"mean {gap['mean_abs']:.2e} nats/token ({verdict})")
    if result.get("rounding"):
        typer.echo(result["rounding"])
    for g in result["gguf"]:
        typer.echo(f"  {g['tensors']}")
    for line in result["commands"]:
        typer.echo(f"  $ {line}")
    if result.get("hub_url"):
        typer.echo(f"uploaded to {result['hub_url']}")
