"""What every tab shares: turning errors into readable UI messages, and the override text format."""

from __future__ import annotations

import functools
import logging
import re
from typing import Callable

from homerlhf.errors import UserError

log = logging.getLogger("homerlhf.app")


def error_text(exc: BaseException) -> str:
    """One readable line for the UI: the UserError message, a settings check's first error with its key,
    or the exception type and message."""
    from pydantic import ValidationError

    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, ValidationError):
        from homerlhf.config.loader import format_validation_error

        return format_validation_error(exc)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]])")


def md_text(text: str) -> str:
    """``text`` shown as it is in a Markdown box: ``<name>`` would be taken for an HTML tag (and the
    rest of the line dropped), ``*`` and ``_`` for emphasis."""
    escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MARKDOWN_SPECIAL.sub(r"\\\1", escaped)


class NotStarted(UserError):
    """A start refused because another run is going: no mistake of the settings, so said as "Not started"."""

    heading = "Not started"


def error_box(message: str, heading: str = "Error") -> str:
    """Markdown for the per-tab message box: the whole message, as written."""
    return f"**{heading}:** {md_text(message)}" if message else ""


def toast(message: str) -> None:
    """A warning toast with ``message`` as written (a toast renders HTML: ``<name>`` would vanish)."""
    import html

    import gradio as gr

    gr.Warning(html.escape(message, quote=False))


def guarded(n_outputs: int, error_index: int | None = None, on_error: dict | None = None) -> Callable:
    """Wrap a Gradio handler so that no exception reaches the browser as a stack trace.

    On error the handler's outputs are left unchanged (``gr.update()``), except the one at
    ``error_index`` (the tab's Markdown message box), which gets the message, and those in
    ``on_error`` (index -> value: what an error must reset, e.g. a verdict that no longer holds); a
    ``gr.Warning`` toast shows the message too. Unexpected errors are logged with their traceback.
    """
    import gradio as gr
    from pydantic import ValidationError

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the UI must never show a traceback
                if not isinstance(exc, (UserError, ValidationError)):
                    log.exception("handler %s failed", fn.__name__)
                message = error_text(exc)
                toast(message)
                outs = [gr.update() for _ in range(n_outputs)]
                for index, value in (on_error or {}).items():
                    outs[index] = value
                if error_index is not None:
                    outs[error_index] = error_box(message, getattr(exc, "heading", "Error"))
                return outs[0] if n_outputs == 1 else tuple(outs)

        return inner

    return wrap


def parse_overrides(text: str) -> list[str]:
    """The overrides box: one ``section.key=value`` per line (values may hold spaces); ``#`` starts a
    comment line."""
    items = []
    for line in (text or "").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise UserError(f"override '{line}' must look like section.key=value, e.g. ppo.kl_coef=0.05")
        items.append(line)
    return items


def set_override(text: str, key: str, value: str) -> str:
    """The overrides text with ``key=value`` replacing any earlier setting of ``key``."""
    kept = [item for item in parse_overrides(text) if item.split("=", 1)[0] != key]
    return "\n".join([*kept, f"{key}={value}"])
