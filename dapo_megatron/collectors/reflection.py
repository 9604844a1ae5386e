"""Which responses reflect on their own reasoning — the paper's "emergence of reflective reasoning", counted as
``response/reflection_rate``: the fraction of responses with at least one of ``trainer.reflection_phrases``
("wait", "let me check", "recheck" ...), matched case-insensitively as whole words, any whitespace between the
words of a phrase."""

from __future__ import annotations

import re


class ReflectionPhrases:
    def __init__(self, phrases: list[str] | tuple[str, ...]):
        words = [r"\s+".join(re.escape(word) for word in phrase.split()) for phrase in phrases if phrase.strip()]
        self._pattern = re.compile(r"(?<!\w)(?:" + "|".join(words) + r")(?!\w)", re.IGNORECASE) if words else None

    def found_in(self, response: str) -> bool:
        return self._pattern is not None and self._pattern.search(response) is not None
