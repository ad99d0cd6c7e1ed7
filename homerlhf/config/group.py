"""The ``group`` section of the run config: GRPO and RLOO's samples per prompt, advantage and loss
(re-exported by :mod:`homerlhf.config.schema`; docs/ppo_details.md, detail 19).

Its keys were once in the ``ppo`` section: :func:`read_old_names` still reads them there, with one
warning line naming the new keys.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Optional

from pydantic import Field

from homerlhf.config.section import Section

log = logging.getLogger(__name__)


class GroupConfig(Section):
    """GRPO / RLOO (``algorithm``): each prompt sampled ``size`` times, the group the baseline."""

    size: int = Field(1, ge=1, description="Responses sampled per prompt (grpo/rloo: >= 2, their baseline is the group).")
    dr_grpo: bool = Field(
        False, description="grpo: Dr. GRPO (no std scaling of advantages, loss divided by B * max_new_tokens).")
    loss_aggregation: Optional[Literal["token_mean", "seq_mean_token_mean", "constant"]] = Field(
        None, description="Per-token losses to one number (None: seq_mean_token_mean for grpo, constant for Dr. GRPO, "
        "token_mean for rloo).")
    kl_in: Optional[Literal["reward", "loss"]] = Field(
        None, description="Where the KL to the reference goes: reward (per token, as ppo.kl_estimator) or loss (k3 per "
        "token, grpo/rloo only). None: loss for grpo, reward otherwise.")


# The old dotted name of each key of this section.
OLD_NAMES = {"size": "ppo.group_size", "dr_grpo": "ppo.dr_grpo", "loss_aggregation": "ppo.loss_aggregation",
             "kl_in": "ppo.kl_in"}


def read_old_names(data: Any) -> Any:
    """``data`` (a run config's raw mapping) with the group keys given under their old names in ``ppo``
    moved to ``group``, and one warning line naming them. A key given under both names is an error."""
    if not isinstance(data, dict) or not isinstance(data.get("ppo"), dict):
        return data
    ppo = dict(data["ppo"])
    group = dict(data.get("group") or {})
    moved = []
    for key, old in OLD_NAMES.items():
        old_key = old.split(".", 1)[1]
        if old_key not in ppo:
            continue
        if key in group:
            raise ValueError(f"{old} and group.{key} are both set: {old} is the old name of group.{key}; keep only it")
        group[key] = ppo.pop(old_key)
        moved.append(f"{old} -> group.{key}")
    if not moved:
        return data
    log.warning("warning: renamed config keys read under their old names (%s); write the new ones, the old "
                "ones will stop working", ", ".join(moved))
    return {**data, "ppo": ppo, "group": group}
