"""Resuming a run: which checkpoint ``--resume RUN_DIR`` continues from, the config it continues
with, and the run's logs cut back to what they held at that checkpoint.

Loading the checkpoint's contents into live objects is :func:`homerlhf.ppo.checkpoint.load_checkpoint`;
which config changes a checkpoint can carry over is ``INCOMPATIBLE_KEYS`` there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

from homerlhf.config import from_yaml_file, load_config
from homerlhf.config.loader import _read_yaml, apply_overrides, deep_merge, validate
from homerlhf.errors import UserError
from homerlhf.ppo.checkpoint import check_resume_compatible, checkpoint_dirs, verify_checkpoint


def truncate_logs(run_dir: str | Path, offsets: Mapping[str, int]) -> None:
    """Cut each log back to its size at checkpoint time: rows of iterations after the checkpoint
    are redone by the resumed run, so keeping them would duplicate them."""
    run_dir = Path(run_dir)
    for name, size in offsets.items():
        path = run_dir / name
        if not path.exists():
            if size:
                raise UserError(f"cannot resume {run_dir}: {name} is missing but the checkpoint counted "
                                f"{size} bytes of it; restore the file or start a new run with --out")
            continue
        if path.stat().st_size < size:
            raise UserError(f"cannot resume {run_dir}: {name} is shorter than when the checkpoint was written; "
                            "restore the file or start a new run with --out")
        with open(path, "r+b") as fh:
            fh.truncate(size)
            fh.flush()
            os.fsync(fh.fileno())


def saved_config(ckpt: str | Path):
    """The resolved ``RunConfig`` a checkpoint was written with."""
    return from_yaml_file(Path(ckpt) / "config.yaml")


def find_resume_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint ``--resume RUN_DIR`` continues from: the newest one, every file of it what its
    manifest recorded; else a one-line error naming the file that is not, or saying there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"--resume {run_dir}: no such run directory; give the --out of an earlier run")
    dirs = checkpoint_dirs(run_dir)  # sealed or not: an unsealed newest one is refused, not passed over
    if not dirs:
        raise UserError(f"--resume {run_dir}: the run has no complete checkpoint yet; start it again with "
                        "--overwrite (checkpoints are written every checkpoint.every iterations and at stop)")
    verify_checkpoint(dirs[-1], fix=lambda fallback: _resume_fix(run_dir, dirs, fallback))
    return dirs[-1]


def _resume_fix(run_dir: Path, dirs: list[Path], fallback: Optional[Path]) -> str:
    if fallback is None:
        return ("no earlier checkpoint is intact: restore the file from a backup, or start the run again "
                "with --overwrite")
    # every checkpoint after the fallback is damaged (it is the newest intact one): all of them move
    newer = dirs[dirs.index(fallback) + 1:]
    moves = " && ".join(f"mv {p} {run_dir}/{p.name}.damaged" for p in newer)
    return (f"move {'it' if len(newer) == 1 else 'them'} out of the way ({moves}) and run "
            f"`homerlhf train --resume {run_dir}` again to continue from {fallback.name}")


def resume_config(run_dir: str | Path, *, preset: Optional[str] = None, config_file: Optional[str | Path] = None,
                  overrides=()):
    """The config of ``--resume RUN_DIR`` and the checkpoint it continues from.

    The base is the config the checkpoint was written with (so ``--resume RUN_DIR`` alone continues
    the same run); a ``--config`` file and ``--set`` overrides go on top, e.g. ``ppo.iterations=200``.
    With an explicit ``preset`` the config is built from scratch instead. Either way a change to an
    ``INCOMPATIBLE_KEYS`` entry is refused in one line naming the key. Returns ``(config, ckpt)``.
    """
    ckpt = find_resume_checkpoint(run_dir)
    saved = saved_config(ckpt)
    if preset is not None:
        new = load_config(preset, config_file, overrides)
    else:
        data = saved.model_dump(mode="json")
        if config_file is not None:
            data = deep_merge(data, _read_yaml(Path(config_file), "config file"))
        new = validate(apply_overrides(data, overrides))
    check_resume_compatible(saved, new, run_dir)
    return new.model_copy(update={"output_dir": str(run_dir)}), ckpt
