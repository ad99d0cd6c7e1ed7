"""Whether the model and dataset hub can be reached, asked once: a download from a hub that cannot be
reached fails only after its retries (24 s for a dataset id here), so callers check first and refuse
at once with a line that says why (:func:`homerlhf.models.registry.check_available`,
:func:`homerlhf.data.read.read_rows`)."""

from __future__ import annotations

import time

HUB_PROBE_TIMEOUT_S = 3.0
_HUB_PROBES: dict[str, tuple[float, str]] = {}  # endpoint -> (when, why unreachable or "")


def hub_unreachable() -> str:
    """Why the hub cannot be reached ('' when it answers): offline mode, or no answer within
    :data:`HUB_PROBE_TIMEOUT_S` to one HEAD request (through the environment's proxy, if any). Kept a
    minute, so a page of checks costs one probe. Any HTTP answer, even an error, counts as reachable."""
    import httpx
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = constants.ENDPOINT
    when, why = _HUB_PROBES.get(endpoint, (0.0, ""))
    if time.monotonic() - when > 60:
        try:
            httpx.head(endpoint, timeout=HUB_PROBE_TIMEOUT_S)
            why = ""
        except httpx.HTTPError as exc:
            why = f"no answer from {endpoint}: {type(exc).__name__}"
        _HUB_PROBES[endpoint] = (time.monotonic(), why)
    return why
