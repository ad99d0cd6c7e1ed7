"""The algorithm view (homerlhf/ppo/loop.py): a reader reaches the policy loss from the iteration in at
most 3 calls of the module's own functions, and the module imports at most 12 of ours; the group loss's
settings by hand. (The iteration itself runs in tests/ppo/test_trainer.py and test_group_trainer.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import homerlhf.ppo.loop as loop
from homerlhf.config import load_config

SOURCE = Path(loop.__file__).read_text()
LOSSES = {"weighted_policy_loss", "clipped_group_loss"}  # homerlhf.ppo.importance's and homerlhf.ppo.group's


def _calls() -> dict[str, set[str]]:
    """Each top-level function of the module -> the names it calls or hands on (``partial(f, ...)``)."""
    out = {}
    for node in ast.parse(SOURCE).body:
        if isinstance(node, ast.FunctionDef):
            named = set()
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call):
                    for target in (inner.func, *inner.args):
                        if isinstance(target, ast.Name):
                            named.add(target.id)
            out[node.name] = named
    return out


def test_the_policy_loss_is_three_calls_from_the_iteration():
    calls, depth, frontier, seen = _calls(), 0, {"iteration"}, set()
    while frontier and not LOSSES & set().union(*(calls.get(f, set()) for f in frontier)):
        seen |= frontier
        frontier = {c for f in frontier for c in calls.get(f, set()) if c in calls and c not in seen}
        depth += 1
    assert frontier, "the policy loss is not reached from iteration"
    assert depth + 1 <= 3, depth + 1  # iteration -> update -> micro_batch_loss -> the loss


def test_the_view_imports_at_most_12_of_our_modules():
    ours = {node.module for node in ast.walk(ast.parse(SOURCE))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("homerlhf")}
    assert len(ours) <= 12, sorted(ours)


def test_group_loss_settings_by_hand():
    assert loop.group_loss(load_config("cpu-tiny"), 0.3) is None  # PPO: the critic's loss, no group loss
    grpo = loop.group_loss(load_config("cpu-tiny", overrides=["algorithm=grpo", "group.size=4"]), 0.3)
    # GRPO's defaults: the k3 KL in the loss at the controller's coefficient, each response's token mean.
    assert (grpo.clip_range, grpo.kl_coef, grpo.mode, grpo.max_len, grpo.per_row) == (0.2, 0.3, "seq_mean_token_mean",
                                                                                       56, True)
    # RLOO's: the KL in the reward (none in the loss), a mean over all response tokens (micro-batches weigh by tokens).
    rloo = loop.group_loss(load_config("cpu-tiny", overrides=["algorithm=rloo", "group.size=2"]), 0.3)
    assert (rloo.kl_coef, rloo.mode, rloo.per_row) == (0.0, "token_mean", False)
