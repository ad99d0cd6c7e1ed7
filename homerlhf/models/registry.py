"""Model names as the user writes them, resolved to something ``from_pretrained`` or the exporter reads.

- :func:`resolve_model`: ``builtin:<name>`` -> a local directory, built once into the cache; a local
  path -> itself (a missing one is a :class:`UserError`); a hub id -> unchanged.
- :func:`resolve_model_dir`: always a local directory (the GGUF exporter reads files): a hub id
  becomes its snapshot in the hub cache, downloaded when the hub can be reached.

Builtin models are registered by name (:func:`register_builtin`): a function that builds one into an
empty directory and the files whose content makes that build. ``builtin:tiny-llama`` and
``builtin:tiny-qwen2`` (random tiny models of :mod:`homerlhf.tiny`) are registered here.
``builtin:demo-sft`` and ``builtin:demo-rm`` are trained by the SFT and reward stages, so
:mod:`homerlhf.stages.builtin` registers them when ``homerlhf.stages`` is imported: this layer never
imports a higher one, and looks builders up only when a name is resolved.

Builds go to ``homerlhf.paths.cache_dir("builtin") / "<name>-v<version>-<hash>"``, the hash being of
the recipe files, so a changed recipe never reuses a stale build. A build runs in a temporary
directory renamed into place when complete, under a file lock, so concurrent processes build once
and never see a half-written model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from homerlhf.errors import UserError

BUILTIN_VERSION = "1"
PREFIX = "builtin:"


@dataclass(frozen=True)
class Builtin:
    """How one builtin model is made."""

    build: Callable[[Path], None]  # writes the model into an empty directory
    recipe: Callable[[], list[Path]]  # the files whose content determines the build
    # The path handed out, from the build's directory (it may also complete an older build).
    finish: Optional[Callable[[Path], Path]] = None


_BUILTINS: dict[str, Builtin] = {}


def register_builtin(name: str, build: Callable[[Path], None], recipe: Callable[[], list[Path]],
                     finish: Optional[Callable[[Path], Path]] = None) -> None:
    """Make ``builtin:<name>`` resolvable: ``build(tmp_dir)`` runs once per ``recipe`` content."""
    _BUILTINS[name] = Builtin(build, recipe, finish)


def builtin_names() -> list[str]:
    """The registered builtin models, ``builtin:`` prefix included, in registration order."""
    return [PREFIX + name for name in _BUILTINS]


def cache_key(name: str) -> str:
    """``<name>-v<version>-<hash of its recipe files>``: the cache directory name of one build."""
    digest = hashlib.sha256()
    for path in _BUILTINS[name].recipe():
        digest.update(path.name.encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return f"{name}-v{BUILTIN_VERSION}-{digest.hexdigest()[:12]}"


def _say(msg: str) -> None:
    print(f"[homerlhf] {msg}", file=sys.stderr, flush=True)


def _build_once(name: str) -> Path:
    """``cache/builtin/<key>``, running the build into a temporary directory renamed there if absent."""
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
            _BUILTINS[name].build(tmp)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _say(f"built {PREFIX}{name}")
    return final


def resolve_model(name_or_path: str) -> str:
    """A model name as the user wrote it -> something ``from_pretrained`` accepts.

    builtin names are built (once) and return a local directory; hub ids and existing local
    directories are returned unchanged.
    """
    name_or_path = str(name_or_path)
    if name_or_path.startswith(PREFIX):
        name = name_or_path[len(PREFIX):]
        if name not in _BUILTINS:
            raise UserError(f"unknown builtin model '{name_or_path}'; choose one of: " + ", ".join(builtin_names()))
        built = _build_once(name)
        finish = _BUILTINS[name].finish
        return str(finish(built) if finish else built)
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


def resolve_model_dir(model: str) -> Path:
    """A local HF model directory for ``model`` (``builtin:<name>``, a directory, or a hub id)."""
    if model.startswith(PREFIX):
        model = resolve_model(model)
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"model path {path} is a file; pass the HF model directory that holds config.json")
        return path
    looks_local = model.startswith((".", "/", "~")) or model.count("/") != 1 or os.sep in model.replace("/", "", 1)
    if looks_local:
        raise UserError(f"model directory {model} does not exist; check the path")
    return _hub_snapshot(model)


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(repo_id, local_files_only=True))
        except Exception:
            if os.environ.get("HF_HUB_OFFLINE") == "1":
                raise
            return Path(snapshot_download(repo_id))
    except Exception as exc:  # any hub failure means the same thing to the user
        raise UserError(
            f"model {repo_id!r} was not found locally and the hub is unreachable ({type(exc).__name__}); "
            f"pass a local HF model directory, or download it first (huggingface-cli download {repo_id})"
        ) from None


# --------------------------------------------------------------------------- the tiny builtins


def tiny_recipe() -> list[Path]:
    """The files that make a tiny builtin: the model code, the corpus its tokenizer learns, this file."""
    import homerlhf.data.builtin as data_builtin
    import homerlhf.tiny as tiny

    return [Path(tiny.__file__), Path(data_builtin.__file__), Path(__file__).resolve()]


def _tiny(arch: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        from homerlhf.tiny import build_causal_lm

        build_causal_lm(out, arch=arch, seed=0)

    return build


register_builtin("tiny-llama", _tiny("llama"), tiny_recipe)
register_builtin("tiny-qwen2", _tiny("qwen2"), tiny_recipe)
