"""Rule-based math reward, the DAPO rule (the verl ``math_dapo`` behaviour, reimplemented).

    R(ŷ, y) = +1  if normalize(ŷ) == normalize(y)
              −1  otherwise

Steps:

1. Only the last ``TAIL_CHARS`` (300) characters of the response are read.
2. ŷ is the text of the *last* match of ``Answer\\s*:\\s*(.+)`` (case-insensitive, up to the end of that line).
   No match: the answer is wrong (score −1, ``pred == ""``).
3. Both ŷ and the ground truth y go through a Minerva-style normalization (``normalize_answer``):
   keep the text after the last ``=``; keep the first ``$...$`` span if there is one; drop ``\\$``, ``$``,
   ``^\\circ``, ordinal ``^\\mathrm{th}``, ``\\dots`` and LaTeX spacing; unwrap ``\\boxed{}``, ``\\text{}``,
   ``\\textbf{}``, ``\\mathrm{}``, ``\\mbox{}``, ``\\overline{}``; remove unit words (``cm``, ``dollars``,
   ``degrees``...); remove all whitespace; ``\\dfrac``/``\\tfrac`` -> ``\\frac``; brace single-character arguments
   (``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``); drop a trailing period; drop thousands
   separators (``12,345`` -> ``12345``).
4. The comparison is an exact string compare: there is no numeric equivalence (``0.5 != \\frac{1}{2}``,
   ``18.0 != 18``), which is what the paper trains with (DAPO-Math-17K answers are integers).

Deliberate differences from a literal Minerva substring replace, all harmless for integer answers: unit words
are removed only as whole words (so ``\\left`` keeps its ``ft``), a trailing period is dropped (``Answer: 42.``),
and a comma list such as ``1,2`` is not mistaken for a thousands separator.

Optional symbolic fallback (``use_math_verify=True``, off by default so the paper's behaviour is the default):
when the exact compare fails, the ``math-verify`` package (``pip install math-verify==0.9.0``) parses the ground
truth and the extracted answer (or, without an ``Answer:`` line, the response tail) and checks symbolic
equivalence. math-verify times out with ``signal.alarm``, which only works in the main thread; called from
another thread the fallback runs without a timeout.

``math_reward`` never raises on string input; the overlong penalty (``overlong.py``) is added to ``score`` by the
caller, while dynamic sampling filters on ``acc``.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

TAIL_CHARS = 300
CORRECT_SCORE = 1.0
INCORRECT_SCORE = -1.0

_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
_FIRST_MATH_SPAN = re.compile(r"\$(.*?)\$", re.DOTALL)
_WHITESPACE = re.compile(r"\s+")
_THOUSANDS_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")

# Removed verbatim (before unwrapping): ordinal suffixes, degree signs, ellipses and LaTeX spacing commands.
_REMOVED_LATEX = (
    r"^{\mathrm{th}}",
    r"^\mathrm{th}",
    r"^{\text{th}}",
    r"^\text{th}",
    r"\mathrm{th}",
    r"^{\circ}",
    r"^\circ",
    r"\ldots",
    r"\dots",
    r"\!",
    r"\,",
    r"\;",
    r"\:",
    r"\ ",
)
# Commands whose single braced argument replaces the whole command: \boxed{12} -> 12.
_UNWRAPPED_COMMANDS = ("boxed", "textbf", "textrm", "text", "mathrm", "mbox", "overline")
# Unit and filler words that trail answers in competition math; removed only as whole words.
_UNIT_WORDS = (
    "square ways integers dollars dollar cents mph inches inch ft feet hours hour minutes km cm meters units points "
    "digits degrees pounds gm edges students meals multiples sue childrentickets"
).split()
_UNIT_PATTERN = re.compile(
    r"(?<![A-Za-z\\])(?:" + "|".join(sorted(_UNIT_WORDS, key=len, reverse=True)) + r")(?![A-Za-z])"
)


@dataclass(frozen=True)
class RewardResult:
    """Outcome of grading one response.

    ``score`` is the correctness reward (+1 / −1) before any overlong penalty; ``acc`` is the correctness used by
    dynamic sampling; ``pred`` is the normalized extracted answer ("" when the response has no ``Answer:`` line).
    """

    score: float
    acc: bool
    pred: str


def extract_answer(response: str) -> str | None:
    """The text after the last ``Answer:`` in the response's last ``TAIL_CHARS`` characters, or None."""
    matches = _ANSWER_LINE.findall(response[-TAIL_CHARS:])
    return matches[-1] if matches else None


def _read_argument(text: str, start: int) -> tuple[str, int] | None:
    """Read one LaTeX argument at ``start``: a balanced ``{...}`` group (content returned), a command such as
    ``\\pi``, or a single character.

    Returns (argument, index after it), or None at end of text. An unclosed group takes the rest of the text.
    """
    if start >= len(text):
        return None
    if text[start] == "\\":
        end = start + 1
        while end < len(text) and text[end].isalpha():
            end += 1
        return text[start : max(end, start + 2)], max(end, start + 2)
    if text[start] != "{":
        return text[start], start + 1
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : index], index + 1
    return text[start + 1 :], len(text)


def _unwrap_command(text: str, command: str) -> str:
    r"""Replace every ``\command{arg}`` by ``arg`` (balanced braces); ``\command`` without a group is kept."""
    marker = "\\" + command + "{"
    while True:
        position = text.find(marker)
        if position < 0:
            return text
        argument, end = _read_argument(text, position + len(marker) - 1)
        text = text[:position] + argument + text[end:]


def _brace_arguments(text: str, command: str, num_args: int) -> str:
    r"""Give ``\command`` braced arguments: ``\frac12`` and ``\frac1{2}`` -> ``\frac{1}{2}``."""
    marker = "\\" + command
    pieces: list[str] = []
    cursor = 0
    while True:
        position = text.find(marker, cursor)
        if position < 0:
            pieces.append(text[cursor:])
            return "".join(pieces)
        after = position + len(marker)
        if after < len(text) and text[after].isalpha():  # a longer command name, e.g. \sqrtx is not \sqrt
            pieces.append(text[cursor:after])
            cursor = after
            continue
        pieces.append(text[cursor:after])
        cursor = after
        for _ in range(num_args):
            argument = _read_argument(text, cursor)
            if argument is None:
                break
            content, cursor = argument
            pieces.append("{" + content + "}")


def normalize_answer(answer: str) -> str:
    """Minerva-style normalization of a final answer string (see the module docstring for the steps)."""
    text = answer.split("=")[-1]
    text = text.replace("\\$", "")
    math_span = _FIRST_MATH_SPAN.search(text)
    if math_span is not None:
        text = math_span.group(1)
    for latex in _REMOVED_LATEX:
        text = text.replace(latex, "")
    text = text.replace("{,}", ",")
    for command in _UNWRAPPED_COMMANDS:
        text = _unwrap_command(text, command)
    text = _UNIT_PATTERN.sub("", text)
    text = _WHITESPACE.sub("", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _brace_arguments(text, "frac", 2)
    text = _brace_arguments(text, "sqrt", 1)
    text = text.replace("$", "").rstrip(".")
    if _THOUSANDS_NUMBER.fullmatch(text):
        text = text.replace(",", "")
    return text


def _import_math_verify():
    try:
        import math_verify
    except ImportError as error:
        raise ImportError(
            "math_reward(use_math_verify=True) needs the optional 'math-verify' package: "
            "pip install math-verify==0.9.0"
        ) from error
    return math_verify


def _math_verify_equivalent(math_verify, candidate: str, ground_truth: str) -> tuple[bool, str]:
    """Symbolic equivalence by math-verify; returns (equivalent, the candidate's parsed answer as a string)."""
    from math_verify.errors import TimeoutException

    # math-verify's timeout uses signal.alarm, which raises outside the main thread; there it runs without one.
    timeout_s = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = math_verify.parse("$" + ground_truth + "$", parsing_timeout=timeout_s)
        parsed = math_verify.parse(candidate, parsing_timeout=timeout_s)
        if not gold or not parsed:
            return False, ""
        equivalent = math_verify.verify(gold, parsed, timeout_seconds=timeout_s)
        return bool(equivalent), str(parsed[-1])
    except (Exception, TimeoutException):  # TimeoutException derives from BaseException
        return False, ""


def math_reward(response: str, ground_truth: str, *, use_math_verify: bool = False) -> RewardResult:
    """Grade one response against the ground-truth answer with the DAPO rule (+1 correct, −1 otherwise).

    Never raises on string input. ``use_math_verify`` adds the symbolic fallback described in the module docstring.
    """
    if not isinstance(response, str):
        raise TypeError(f"math_reward: response must be str, got {type(response).__name__}")
    if not isinstance(ground_truth, str):
        raise TypeError(f"math_reward: ground_truth must be str, got {type(ground_truth).__name__}")

    math_verify = _import_math_verify() if use_math_verify else None  # fail fast when the extra is missing
    extracted = extract_answer(response)
    pred = normalize_answer(extracted) if extracted is not None else ""
    correct = pred != "" and pred == normalize_answer(ground_truth)

    if not correct and math_verify is not None:
        candidate = extracted if extracted is not None else response[-TAIL_CHARS:]
        correct, verified_pred = _math_verify_equivalent(math_verify, candidate, ground_truth)
        if correct and not pred:
            pred = verified_pred

    return RewardResult(score=CORRECT_SCORE if correct else INCORRECT_SCORE, acc=correct, pred=pred)
