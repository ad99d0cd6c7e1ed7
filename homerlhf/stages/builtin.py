"""Builtin model names (``builtin:<name>``) resolved to local HF directories, built once and cached.

``resolve_model`` is what every stage calls on a model name before ``from_pretrained``:

- ``builtin:tiny-llama`` / ``builtin:tiny-qwen2``: tokenizer + randomly initialised tiny causal LM
  (:mod:`homerlhf.tiny`);
- ``builtin:demo-sft``: tiny Llama after full SFT on the builtin instruction records; the path of
  the SFT run's ``model/`` directory;
- ``builtin:demo-rm``: reward model trained on the builtin preference pairs, initialised from
  demo-sft; the path of the reward *run* directory (``model/``, ``adapter/`` when LoRA,
  ``gguf/`` for the llama.cpp worker, ``reward_run.json``).

Anything else is returned unchanged (a hub id or a local directory), except a string that looks
like a local path and does not exist, which is a :class:`UserError`.

Builds go to ``homerlhf.paths.cache_dir("builtin") / "<name>-v<version>-<hash>"``, the hash being
of the code and preset that produce that build, so a changed recipe never reuses a stale
build. A build runs in a temporary directory renamed into place when complete, under a file lock,
so concurrent processes build once and never see a half-written model.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from homerlhf.errors import UserError

BUILTIN_VERSION = "1"
PREFIX = "builtin:"
NAMES = ("tiny-llama", "tiny-qwen2", "demo-sft", "demo-rm")


def _recipe_files(name: str) -> list[Path]:
    """The files whose content determines the build of ``builtin:<name>``."""
    import homerlhf.data.builtin as data_builtin
    import homerlhf.tiny as tiny
    from homerlhf.config import presets_dir

    here = Path(__file__).resolve().parent
    files = [Path(tiny.__file__), Path(data_builtin.__file__), here / "builtin.py"]
    if name.startswith("demo-"):
        files += [
            Path(data_builtin.__file__).with_name("load.py"),
            here / "common.py",
            here / "sft.py",
            presets_dir() / "cpu-tiny.yaml",
        ]
    if name == "demo-rm":
        files.append(here / "reward.py")
    return files


def cache_key(name: str) -> str:
    """``<name>-v<version>-<hash of its recipe files>``: the cache directory name of one build."""
    digest = hashlib.sha256()
    for path in _recipe_files(name):
        digest.update(path.name.encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return f"{name}-v{BUILTIN_VERSION}-{digest.hexdigest()[:12]}"


def _say(msg: str) -> None:
    print(f"[homerlhf] {msg}", file=sys.stderr, flush=True)


def _build_once(name: str, build: Callable[[Path], None]) -> Path:
    """``cache/builtin/<key>/<name>``, running ``build(tmp_dir)`` and renaming it there if absent."""
    from filelock import FileLock

    from homerlhf.paths import cache_dir

    root = cache_dir("builtin")
    final = root / cache_key(name)
    if final.is_dir():
        return final
    with FileLock(str(root / f".{final.name}.lock")):
        if final.is_dir():  # another process built it while we waited
            return final
        _say(f"building {PREFIX}{name} (once; cached in {root})")
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            build(tmp)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _say(f"built {PREFIX}{name}")
    return final


def _tiny(arch: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        from homerlhf.tiny import build_causal_lm

        build_causal_lm(out, arch=arch, seed=0)

    return build


def demo_config(**overrides):
    """The cpu-tiny preset with ``dotted.key=value`` overrides: the recipe of the demo builds."""
    from homerlhf.config import load_config

    return load_config("cpu-tiny", overrides=[f"{k}={v}" for k, v in overrides.items()])


def _build_demo_sft(out: Path) -> None:
    from homerlhf.stages.sft import run_sft

    cfg = demo_config()
    run_sft(cfg, out, data="builtin:demo-sft", base=f"{PREFIX}tiny-llama")


def _build_demo_rm(out: Path) -> None:
    from homerlhf.stages.reward import run_reward

    cfg = demo_config()
    run_reward(cfg, out, data="builtin:demo-pairs", base=f"{PREFIX}demo-sft")


def resolve_model(name_or_path: str) -> str:
    """A model name as the user wrote it -> something ``from_pretrained`` accepts.

    builtin names are built (once) and return a local directory; hub ids and existing local
    directories are returned unchanged.
    """
    name_or_path = str(name_or_path)
    if name_or_path.startswith(PREFIX):
        name = name_or_path[len(PREFIX):]
        if name == "tiny-llama":
            return str(_build_once(name, _tiny("llama")))
        if name == "tiny-qwen2":
            return str(_build_once(name, _tiny("qwen2")))
        if name == "demo-sft":
            return str(_build_once(name, _build_demo_sft) / "model")
        if name == "demo-rm":
            run_dir = _build_once(name, _build_demo_rm)
            _ensure_rm_gguf(run_dir)
            return str(run_dir)
        raise UserError(
            f"unknown builtin model '{name_or_path}'; choose one of: "
            + ", ".join(PREFIX + n for n in NAMES)
        )
    if _looks_like_path(name_or_path) and not Path(name_or_path).expanduser().exists():
        raise UserError(f"model path '{name_or_path}' does not exist (check the path, or give a hub id)")
    return str(Path(name_or_path).expanduser()) if _looks_like_path(name_or_path) else name_or_path


def _looks_like_path(s: str) -> bool:
    # A hub id is "name" or "org/name"; anything else with a separator or a leading dot/tilde is a path.
    return (
        s.startswith((".", "/", "~"))
        or "\\" in s
        or s.count("/") > 1
        or Path(s).suffix in {".gguf", ".safetensors", ".bin"}
        or Path(s).exists()
    )


def _ensure_rm_gguf(run_dir: Path) -> None:
    """A cached demo-rm built before the GGUF exporter existed gets its ``gguf/`` now."""
    if (run_dir / "gguf").is_dir():
        return
    from homerlhf.stages.reward import export_gguf

    cfg = demo_config()
    export_gguf(run_dir, outtype=cfg.reward.outtype)
