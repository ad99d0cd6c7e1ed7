"""docs/guide.md as a user runs it: every command of its bash blocks, in order, through the installed wheel
(tests/wheel_venv.py) from a folder outside the checkout, on the user's own files (a few rows in the formats
the guide shows) and tiny stand-ins: the `cpu-tiny` preset for the card's, a tiny Llama built from code for
the 7B model, one step or iteration each (STANDINS, SHRINK). `plan` and `config` run as written: they read
only shapes and settings. This is also the wheel's check of sft, reward, a cpu-tiny train, the app and
`export policy` with a GGUF (tests/test_wheel.py checks the rest)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import httpx
import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
TRAINS = ("sft", "reward", "train")  # the commands that load weights: they run on the stand-ins
STANDINS = {"4090": "cpu-tiny"}  # --preset; and the 7B model -> the tiny Llama (below)
SHRINK = {
    "sft": ["sft.max_steps=1", "sft.batch_size=4", "logging.progress=false"],
    "reward": ["rm.max_steps=1", "rm.batch_size=4", "logging.progress=false"],
    "train": ["ppo.iterations=1", "rollout.batch_size=4", "rollout.chunk_size=4", "ppo.mini_batch_size=4",
              "ppo.micro_batch_size=4", "rollout.max_new_tokens=8", "logging.progress=false"],
}
TOPICS = ["ferns", "cacti", "roses", "tulips", "moss", "ivy", "basil", "mint"]


def guide_commands() -> list[str]:
    """The command lines of the guide's bash blocks, in order, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), re.S)
    return [line.split(" #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def stand_in(args: list[str], tiny: Path) -> list[str]:
    if args[0] not in TRAINS:
        return args
    out = [STANDINS.get(a, a) if i and args[i - 1] == "--preset" else a for i, a in enumerate(args)]
    out = [str(tiny) if a.startswith("Qwen/") else a for a in out]
    return out + [x for s in SHRINK[args[0]] for x in ("--set", s)]


def write_users_files(where: Path) -> None:
    def jsonl(name, rows):
        (where / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl("my_sft.jsonl", [{"prompt": f"How do I water {t}?", "completion": f"Water {t} when the soil is dry."}
                           for t in TOPICS])
    jsonl("my_pairs.jsonl", [{"prompt": f"How do I water {t}?", "chosen": f"Water {t} when the soil is dry.",
                              "rejected": "Just pour."} for t in TOPICS])
    jsonl("my_prompts.jsonl", [{"prompt": f"How do I repot {t}?"} for t in TOPICS])


def test_the_guide_has_each_step_once_in_order():
    names = [shlex.split(line)[1] for line in guide_commands()]
    assert all(line.startswith("homerlhf ") for line in guide_commands())
    assert names == ["plan", "config", "sft", "reward", "train", "app", "export"]
    train = next(line for line in guide_commands() if line.startswith("homerlhf train"))
    assert "--data my_prompts.jsonl" in train and "--model runs/sft/model" in train and "--reward runs/reward" in train


@pytest.mark.slow
def test_every_command_of_the_guide_runs_in_order(installed_wheel, tiny_llama_dir, tmp_path):
    write_users_files(tmp_path)
    printed = {}
    for line in guide_commands():
        args = stand_in(shlex.split(line)[1:], tiny_llama_dir)
        if args[0] == "app":
            with installed_wheel.app(*args[1:], cwd=tmp_path) as url:
                config = httpx.get(url + "/config", timeout=30).json()  # the page's blocks, as a browser reads them
                assert config["title"].startswith("homerlhf")
            continue
        proc = installed_wheel.run(*args, cwd=tmp_path, CUDA_VISIBLE_DEVICES="")
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr and "FutureWarning" not in proc.stderr, proc.stderr[-3000:]
        printed[args[0]] = proc.stdout
    assert "verdict" in printed["plan"].lower() or "fits" in printed["plan"].lower(), printed["plan"][-1500:]
    assert printed["config"].splitlines()[1].startswith("rollout.")
    assert printed["sft"].strip().splitlines()[-1].startswith(f"sft done: {len(TOPICS)} examples")
    assert printed["reward"].strip().splitlines()[-1].startswith(f"reward done: {len(TOPICS)} pairs")
    # The run trained on the user's prompts, and said so in its data line.
    assert f"data: my_prompts.jsonl: prompt (prompt), {len(TOPICS)} rows, {len(TOPICS)} usable" in printed["train"]
    assert "PPO done: 1 iterations" in printed["train"]
    assert [line for line in printed["train"].splitlines() if "llama_" in line] == []
    samples = [json.loads(x) for x in (tmp_path / "runs" / "ppo" / "samples.jsonl").read_text().splitlines()]
    assert samples and all("How do I repot" in s["prompt"] for s in samples)
    assert (tmp_path / "exports" / "mine" / "config.json").is_file()
    assert [p.name for p in (tmp_path / "exports" / "mine" / "gguf").glob("*.gguf")] == ["mine-q4_k_m.gguf"]
