"""Rewards computed by Python functions from the user's own file, and weighted sums of rewards.

``reward.function: path/to/rewards.py:fn`` names a file and a function in it. The file is imported from
that path only (:func:`load_reward_function`): nothing is searched on ``sys.path``. The function is
called once per sample with the keyword arguments it declares among :data:`SAMPLE_ARGS` (or all of
them if it takes ``**kwargs``)::

    def correct(response: str, row: dict) -> float | None:
        return 1.0 if response.strip().startswith(str(row["answer"])) else 0.0

It returns a number, or None for "no reward" (0 in the total, counted in ``reward_<name>_none``);
anything else is a :class:`RewardFunctionError` naming the function and the sample. docs/rewards.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import numbers
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import homerlhf.data as data_pkg
from homerlhf.errors import UserError
from homerlhf.ppo.backends import RewardBackend, TokenIds

# ``prompt``/``response``: the decoded texts (special tokens skipped); ``prompt_ids``/``response_ids``: the
# token ids; ``row``: the prompt's dataset row with every column (``{}`` when scoring outside a run).
SAMPLE_ARGS = ("prompt", "response", "prompt_ids", "response_ids", "row")
BUILTIN_FUNCTIONS = {  # name -> (file in homerlhf/data, function)
    "builtin:reverse": ("builtin_reverse.py", "reward"),
    "builtin:reverse-positions": ("builtin_reverse.py", "position_reward"),
    "builtin:capitals": ("builtin_capitals.py", "reward"),
}


class RewardFunctionError(UserError):
    """A reward function failed on a sample: the run stops (after a checkpoint) with this line."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=1)


def parse_function_spec(spec: str, key: str = "reward.function") -> tuple[Path, str]:
    """``"path/to/file.py:fn"`` (or a ``builtin:`` name) -> (file path, function name)."""
    if spec in BUILTIN_FUNCTIONS:
        file_name, fn_name = BUILTIN_FUNCTIONS[spec]
        return Path(data_pkg.__file__).parent / file_name, fn_name
    if spec.startswith("builtin:"):
        raise UserError(f"{key} '{spec}' is not a builtin reward function; choose one of: {', '.join(BUILTIN_FUNCTIONS)}")
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise UserError(f"{key} '{spec}' must look like path/to/file.py:function_name "
                        f"(or one of {', '.join(BUILTIN_FUNCTIONS)})")
    return Path(path).expanduser(), name


def _import_file(path: Path, key: str):
    # A module name of our own per file: two reward files both called rewards.py do not collide,
    # and the user's file never shadows (or is shadowed by) an installed module.
    name = f"homerlhf_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{key}: cannot import {path} (give a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything at import
        del sys.modules[name]
        raise UserError(f"{key}: importing {path} raised {type(exc).__name__}: {_first_line(exc)} (fix the file)") from None
    return module


def _accepted_args(fn: Callable, where: str) -> tuple[str, ...]:
    """The :data:`SAMPLE_ARGS` that ``fn`` takes by keyword; an unknown required parameter is an error."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return SAMPLE_ARGS  # a builtin or C callable: offer everything
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return SAMPLE_ARGS
    accepted = []
    for p in params:
        if p.name in SAMPLE_ARGS and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            accepted.append(p.name)
        elif p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,):
            raise UserError(f"{where} takes parameter '{p.name}'; a reward function takes some of "
                            f"{', '.join(SAMPLE_ARGS)} by name (or **kwargs)")
    return tuple(accepted)


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function: what it is called (``where``) and which sample fields it takes."""

    where: str  # "rewards.py:fn", for messages
    fn: Callable[..., Any]
    args: tuple[str, ...]

    def __call__(self, sample: dict[str, Any]) -> Optional[float]:
        """The function's reward for one sample (the :data:`SAMPLE_ARGS` dict), checked."""
        try:
            value = self.fn(**{name: sample[name] for name in self.args})
        except Exception as exc:  # noqa: BLE001 - the user's function may raise anything
            raise RewardFunctionError(
                f"reward function {self.where} raised {type(exc).__name__}: {_first_line(exc)} "
                f"on {describe_sample(sample)}") from None
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            shown = repr(value)[:40]
            raise RewardFunctionError(
                f"reward function {self.where} returned {shown} ({type(value).__name__}) on {describe_sample(sample)}; "
                "return a finite number, or None for no reward")
        return float(value)


def load_reward_function(spec: str, key: str = "reward.function") -> RewardFunction:
    """Import ``spec``'s file from its path and return its function, checked to be callable with
    keyword arguments among :data:`SAMPLE_ARGS`. Every failure is a one-line UserError."""
    path, name = parse_function_spec(spec, key)
    if not path.is_file():
        raise UserError(f"{key}: file {path} not found (give path/to/file.py:function_name, the path relative "
                        "to the working directory)")
    if path.suffix != ".py":
        raise UserError(f"{key}: {path} is not a .py file")
    module = _import_file(path.resolve(), key)
    where = f"{path.name}:{name}"
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise UserError(f"{key}: {path} has no function '{name}' (it defines: {', '.join(defined) or 'none'})")
    if not callable(fn):
        raise UserError(f"{key}: {where} is not a function (it is {type(fn).__name__})")
    return RewardFunction(where, fn, _accepted_args(fn, f"{key}: {where}"))


def describe_sample(sample: dict[str, Any]) -> str:
    """The sample in a few words: the first characters of its prompt and response."""
    return f"the sample with prompt {_clip(sample['prompt'])} and response {_clip(sample['response'])}"


def _clip(text: str, n: int = 40) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= n else text[:n] + "...")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else "(no message)"


class FunctionReward(RewardBackend):
    """A :class:`RewardFunction` as a reward backend: decodes the ids with ``tokenizer`` and calls
    it once per sample. Scores may be None (no reward); :class:`WeightedReward` turns them into 0."""

    def __init__(self, function: RewardFunction, tokenizer):
        self.function = function
        self.tokenizer = tokenizer

    def score_samples(self, prompt_ids: TokenIds, response_ids: TokenIds,
                      rows: Optional[Sequence[dict]] = None) -> list[Optional[float]]:
        decode = self.tokenizer.decode
        out = []
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
            sample = {"prompt": decode(list(p), skip_special_tokens=True),
                      "response": decode(list(r), skip_special_tokens=True), "prompt_ids": list(p),
                      "response_ids": list(r), "row": dict(rows[i]) if rows is not None else {}}
            out.append(self.function(sample))
        return out

    def score(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[Optional[float]]:
        return self.score_samples(prompt_ids, response_ids)


class WeightedReward(RewardBackend):
    """``total = sum_k weight_k * score_k`` over named rewards (None counts as 0).

    Each part's scores are kept until :meth:`take_component_scores` (once per iteration, after
    every chunk was scored), for the ``reward_<name>`` metrics.
    """

    def __init__(self, parts: Sequence[tuple[str, float, RewardBackend]]):
        self.parts = list(parts)
        self._lock = threading.Lock()
        self._scores: dict[str, list[Optional[float]]] = {name: [] for name, _, _ in self.parts}

    @property
    def shares_policy(self) -> bool:  # one part on the policy's modules keeps the whole sum off threads
        return any(backend.shares_policy for _, _, backend in self.parts)

    @property
    def on_trainer_cpu(self) -> bool:  # as does one part on the trainer's CPU cores
        return any(backend.on_trainer_cpu for _, _, backend in self.parts)

    def score_samples(self, prompt_ids: TokenIds, response_ids: TokenIds,
                      rows: Optional[Sequence[dict]] = None) -> list[float]:
        by_part = [(name, weight, backend.score_samples(prompt_ids, response_ids, rows))
                   for name, weight, backend in self.parts]
        with self._lock:
            for name, _, scores in by_part:
                self._scores[name].extend(scores)
        return [sum(weight * (scores[i] if scores[i] is not None else 0.0) for _, weight, scores in by_part)
                for i in range(len(prompt_ids))]

    def score(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[float]:
        return self.score_samples(prompt_ids, response_ids)

    def take_component_scores(self) -> dict[str, list[Optional[float]]]:
        with self._lock:
            taken, self._scores = self._scores, {name: [] for name, _, _ in self.parts}
        return taken

    def close(self) -> None:
        for _, _, backend in self.parts:
            backend.close()
        super().close()


def component_metrics(components: dict[str, list[Optional[float]]]) -> dict[str, float]:
    """``reward_<name>``: mean of the part's scores where it gave one (absent if it gave none);
    ``reward_<name>_none``: the fraction of samples it gave None for."""
    row: dict[str, float] = {}
    for name, scores in components.items():
        given = [s for s in scores if s is not None]
        if given:
            row[f"reward_{name}"] = sum(given) / len(given)
        row[f"reward_{name}_none"] = (len(scores) - len(given)) / len(scores) if scores else 0.0
    return row
