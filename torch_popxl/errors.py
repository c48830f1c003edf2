"""Error types raised by torch_popxl.

User mistakes raise the builtin ``ValueError`` / ``TypeError`` / ``RuntimeError`` (as PopXL
does). IR-construction errors that PopXL reports from its C++ core (``popart_exception``)
raise :class:`PopXLError`, so programs can catch one project error class.
"""

__all__ = [
    "PopXLError",
    "UndefinedValue",
    "DataDependentError",
    "IrVerificationError",
    "ApplicationRuntimeError",
]


class PopXLError(RuntimeError):
    """An IR construction or compilation error (PopXL's ``popart_exception``)."""


class UndefinedValue(ValueError):
    """A tensor attribute (for example ``ipu``) was read before it was set."""


class ApplicationRuntimeError(RuntimeError):
    """A check compiled into the program failed while it ran (Poplar's
    ``application_runtime_error``, ``popart.poplar_application_runtime_error``)."""


class DataDependentError(PopXLError):
    """Python control flow or ``.item()`` needed a tensor value while capturing a graph."""


class IrVerificationError(PopXLError):
    """``Ir.verify()`` found a malformed graph (a torch_popxl bug or a hand-edited graph)."""


def given(value: object, limit: int = 80) -> str:
    """``value`` as an error message names what was given: its type and (shortened) repr,
    e.g. ``float 2.5``."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"
