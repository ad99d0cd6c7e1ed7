"""What the Plan tab's *Apply suggestion* applies: the memory suggestion when the plan does not fit (or
is tight), else the time section's placement recommendation (the overrides its "recommended: add ..."
line names), else nothing, with the reason that holds for this plan (not a guess between two)."""

from __future__ import annotations

from homerlhf.app.common import set_override
from homerlhf.errors import UserError

NO_FIT = "no setting in the search fits with 10% of the card free: use a smaller model or a larger card"
NOTHING_TO_APPLY = "nothing to apply: the plan fits and its placement is the fastest that fits"
NO_PLAN = "no suggestion to apply: run Plan first (the last plan failed, or none ran yet)"


def suggestion_overrides(plan) -> list[str]:
    """The planner's suggestion as ``section.key=value`` items ([] when it fits or none fits)."""
    return list(plan.suggestion.set_args) if plan.suggestion is not None else []


def apply_choice(plan) -> dict:
    """What *Apply suggestion* applies for ``plan``: ``{"items", "what"}``, or ``{"items": [], "why"}``."""
    items = suggestion_overrides(plan)
    if items:
        return {"items": items, "what": "the memory suggestion"}
    if plan.fits is False:
        return {"items": [], "why": f"no suggestion to apply: {NO_FIT}"}
    rec = plan.timing
    if rec is not None and rec.set_args():
        return {"items": rec.set_args(), "what": "the recommended placement"}
    return {"items": [], "why": NOTHING_TO_APPLY}


def on_apply(choice, overrides, preset):
    """The last plan's :func:`apply_choice` written into the overrides text: (message, overrides, applied)."""
    items = list((choice or {}).get("items") or [])
    if not items:
        raise UserError((choice or {}).get("why") or NO_PLAN)
    for item in items:
        key, _, value = item.partition("=")
        overrides = set_override(overrides, key, value)
    return (f"Applied: {' '.join(f'`{i}`' for i in items)} ({choice.get('what', 'the suggestion')})", overrides,
            {"preset": preset, "items": items})
