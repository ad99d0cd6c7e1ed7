"""Reward functions in the app: the run's reward (a function or the preset's reward model) plus
weighted components, written into the shared overrides; and a check of a function on dataset rows.

The boxes live in the Plan tab beside the algorithm (:mod:`homerlhf.app.plan_tab`); the Data tab
scores the loaded rows with the chosen function (:func:`check_table`); the Train tab's command then
carries the overrides. Loading and calling a function is :mod:`homerlhf.ppo.reward_functions`'s.
"""

from __future__ import annotations

from typing import Any, Optional

from homerlhf.app.common import parse_overrides, set_override
from homerlhf.errors import UserError

REWARD_KEYS = ("reward.backend", "reward.function", "reward.components")
N_CHECKED = 8


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"  # a YAML single-quoted scalar


def component_item(line: str) -> str:
    """One line of the components box, ``WEIGHT SPEC``, as a YAML flow mapping. ``SPEC`` is a
    function (``path/to/file.py:fn`` or ``builtin:...``) or ``rm:MODEL`` (a reward model served by a
    llama.cpp worker)."""
    from homerlhf.ppo.reward_functions import parse_function_spec

    weight_text, _, spec = line.strip().partition(" ")
    spec = spec.strip()
    try:
        weight = float(weight_text)
    except ValueError:
        raise UserError(f"reward component '{line.strip()}' must look like WEIGHT SPEC, e.g. "
                        "0.5 builtin:reverse-positions") from None
    if not spec:
        raise UserError(f"reward component '{line.strip()}' names no reward after its weight "
                        "(a path/to/file.py:fn, builtin:..., or rm:MODEL)")
    if spec.startswith("rm:"):
        return f"{{backend: llamacpp, model: {_quoted(spec[3:])}, weight: {weight:g}}}"
    parse_function_spec(spec, key=f"reward component '{line.strip()}'")
    return f"{{backend: function, function: {_quoted(spec)}, weight: {weight:g}}}"


def reward_overrides(function: str, components: str) -> list[tuple[str, str]]:
    """``(key, value)`` overrides for the reward: a function as the run's own reward (none: the
    preset's), and the components box (one ``WEIGHT SPEC`` per line) as ``reward.components``."""
    from homerlhf.ppo.reward_functions import parse_function_spec

    items: list[tuple[str, str]] = []
    function = (function or "").strip()
    if function:
        parse_function_spec(function)
        items += [("reward.backend", "function"), ("reward.function", function)]
    lines = [line for line in (components or "").splitlines() if line.strip() and not line.strip().startswith("#")]
    if lines:
        items.append(("reward.components", "[" + ", ".join(component_item(line) for line in lines) + "]"))
    return items


def apply_rewards(overrides: str, function: str, components: str) -> str:
    """The overrides text with earlier reward settings replaced by these (removed when both are empty)."""
    new = reward_overrides(function, components)
    kept = "\n".join(i for i in parse_overrides(overrides) if i.split("=", 1)[0] not in REWARD_KEYS)
    for key, value in new:
        kept = set_override(kept, key, value)
    return kept


def check_table(spec: str, rows: list[dict[str, Any]], n: int = N_CHECKED) -> list[list]:
    """The function on the first ``n`` dataset rows: ``[prompt, answer, reward(answer), reward("")]``.
    A row's own ``answer`` (when it has one) should score high and an empty reply low; a function that
    raises or returns a non-number shows its one-line error instead."""
    from homerlhf.ppo.reward_functions import load_reward_function

    if not (spec or "").strip():
        raise UserError("type a reward function first (path/to/file.py:fn or builtin:reverse)")
    fn = load_reward_function(spec.strip())
    table = []
    for row in rows[:n]:
        prompt = str(row.get("prompt", ""))
        answer: Optional[str] = row.get("answer")
        table.append([prompt, "" if answer is None else str(answer),
                      _score(fn, prompt, "" if answer is None else str(answer), row) if answer is not None else "",
                      _score(fn, prompt, "", row)])
    return table


def _score(fn, prompt: str, response: str, row: dict) -> str:
    from homerlhf.ppo.reward_functions import RewardFunctionError

    try:
        value = fn({"prompt": prompt, "response": response, "prompt_ids": [], "response_ids": [], "row": row})
    except RewardFunctionError as exc:
        return str(exc)
    return "None" if value is None else f"{value:g}"
