"""The demo models, trained by the SFT and reward stages and registered as builtin models.

- ``builtin:demo-sft``: tiny Llama after full SFT on the builtin instruction records; resolves to
  the SFT run's ``model/`` directory;
- ``builtin:demo-rm``: reward model trained on the builtin preference pairs, initialised from
  demo-sft; resolves to the reward *run* directory (``model/``, ``adapter/`` when LoRA, ``gguf/``
  for the llama.cpp worker, ``reward_run.json``);
- ``builtin:reverse-sft``: tiny Llama after a short full SFT on the builtin digit-reversal task
  (:mod:`homerlhf.data.builtin_reverse`), answering in both of its styles and right on about a
  fifth of sampled answers: room and a signal for RL.

Importing ``homerlhf.stages`` registers them in :mod:`homerlhf.models.registry`, which builds each
once into the cache (keyed by the hash of the files below) and resolves every other model name.
"""

from __future__ import annotations

from pathlib import Path

from homerlhf.models.registry import PREFIX, register_builtin, tiny_recipe


TASK_FILES = {"demo": "builtin.py", "reverse": "builtin_reverse.py"}  # in homerlhf/data/


def _recipe_files(rm: bool, task: str = "demo") -> list:
    """The files (paths; the preset a package resource) whose content determines the build of demo-sft
    (and, with ``rm``, demo-rm), or with ``task="reverse"`` of reverse-sft: the loaders and that task's
    own file, not the other task's (though :func:`tiny_recipe` keys every build by the demo task's
    file, the tokenizer's corpus)."""
    import homerlhf.data.builtin as data_builtin
    import homerlhf.models.policy as policy
    from homerlhf.config import presets_dir

    here = Path(__file__).resolve().parent
    other_tasks = set(TASK_FILES.values()) - {TASK_FILES[task]}
    data_files = [f for f in sorted(Path(data_builtin.__file__).parent.glob("*.py")) if f.name not in other_tasks]
    files = tiny_recipe() + [
        here / "builtin.py",
        *data_files,  # the loaders and the task's own file
        Path(policy.__file__),  # the tokenizer loader and the 4-bit settings
        here / "common.py",
        here / "sft.py",
        presets_dir() / "cpu-tiny.yaml",
    ]
    return files + [here / "reward.py"] if rm else files


def demo_config(**overrides):
    """The cpu-tiny preset with ``dotted.key=value`` overrides: the recipe of the demo builds."""
    from homerlhf.config import load_config

    return load_config("cpu-tiny", overrides=[f"{k}={v}" for k, v in overrides.items()])


# Batches of 32 at lr 4e-3 for the preset's 10 epochs (the preset: 16 at 3e-3): the same time, and an
# SFT policy that leaves PPO more to raise without garbling the task's sentences (measured on AMD EPYC
# with the demo's recipe, seeds 0-4: checker gain +0.39 median, +0.35 with the preset's SFT;
# docs/demo.md, "The RL recipe").
DEMO_SFT = {"sft.batch_size": 32, "sft.lr": 4e-3}


def _build_demo_sft(out: Path) -> None:
    from homerlhf.stages.sft import run_sft

    cfg = demo_config(**DEMO_SFT)
    run_sft(cfg, out, data="builtin:demo-sft", base=f"{PREFIX}tiny-llama")


# 1,800 pairs (builtin.N_PAIRS) in batches of 32 for 2 epochs: measured on held-out pairs of every
# rejected kind, as good as 2,400 pairs and better than 1,200 in batches of 16 (docs/demo.md, "The RL
# recipe"); the time goes with the pairs seen, not the batch. lr 7e-4 (the preset: 1e-3): with the
# larger share of other-topic pairs, held-out 0.960 against 0.94 at 1e-3 on the preset's SFT model
# (AMD EPYC); 0.945 on DEMO_SFT's, under default and AVX2 kernels.
DEMO_RM = {"rm.batch_size": 32, "rm.lr": 7e-4}


KIND_PAIRS = 80  # held-out pairs per rejected kind in the reward model's per-kind check


def kind_accuracies(run_dir: Path, per_kind: int = KIND_PAIRS) -> dict[str, float]:
    """Pairwise accuracy of the reward model in ``run_dir/model`` on ``per_kind`` held-out pairs of
    each rejected kind (:data:`homerlhf.data.builtin.REJECTED_KINDS`), every rejected reply made
    from its own chosen one where the kind allows: whether garbling, a typo or another topic's fact
    can fool it, kind by kind."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from homerlhf.data import builtin
    from homerlhf.data.load import normalise
    from homerlhf.stages.reward import pair_ids, pairwise_accuracy

    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    max_len = demo_config().rm.max_len
    accuracies = {}
    for kind in builtin.REJECTED_KINDS:
        records = [r for _, r in builtin.labelled_pairs(n=per_kind, held_out=True, kinds={kind: 1.0})]
        records, _ = normalise(records, "preference")
        pairs = pair_ids(records, tokenizer, max_len)
        accuracies[kind] = round(pairwise_accuracy(model, pairs, tokenizer.pad_token_id), 4)
    return accuracies


def _build_demo_rm(out: Path) -> None:
    from homerlhf.stages.common import write_json
    from homerlhf.stages.reward import run_reward

    summary = run_reward(demo_config(**DEMO_RM), out, data="builtin:demo-pairs", base=f"{PREFIX}demo-sft")
    write_json(out / "reward_run.json", {**summary, "held_out_accuracy_per_kind": kind_accuracies(out)})


# Short on purpose: the model learns both answer styles and part of the task, so sampled answers
# vary within a group and RL has something to raise (measured: 20% of sampled held-out answers right).
REVERSE_SFT = {"sft.epochs": 6, "sft.max_len": 48}


def _build_reverse_sft(out: Path) -> None:
    from homerlhf.stages.sft import run_sft

    run_sft(demo_config(**REVERSE_SFT), out, data="builtin:reverse-sft", base=f"{PREFIX}tiny-llama")


def _ensure_rm_gguf(run_dir: Path) -> Path:
    """A cached demo-rm built before the GGUF exporter existed gets its ``gguf/`` now."""
    if not (run_dir / "gguf").is_dir():
        from homerlhf.stages.reward import export_gguf

        export_gguf(run_dir, outtype=demo_config().reward.outtype)
    return run_dir


register_builtin("demo-sft", _build_demo_sft, lambda: _recipe_files(rm=False), finish=lambda built: built / "model")
# A full fine-tune with its llama.cpp export, no LoRA on the policy's base: never reward.backend=adapter.
register_builtin("demo-rm", _build_demo_rm, lambda: _recipe_files(rm=True), finish=_ensure_rm_gguf,
                 reward_backends=("llamacpp", "hf"))
register_builtin("reverse-sft", _build_reverse_sft, lambda: _recipe_files(rm=False, task="reverse"),
                 finish=lambda built: built / "model")
