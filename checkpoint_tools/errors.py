"""The one error the checkpoint tools raise for bad input (the CLIs print it and exit with status 2)."""

from __future__ import annotations


class ConversionError(ValueError):
    """The input cannot be converted as asked; the message names what is wrong and where. No output was written."""
