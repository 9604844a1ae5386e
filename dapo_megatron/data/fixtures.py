"""Small data files shipped with the package (original problems written for this project, no dataset rows).

- ``dapo_math_fixture.jsonl``: 37 rows, 30 unique integer-answer problems in the exact DAPO-Math-17K schema and
  prompt wording (instruction, problem, reminder to end with ``Answer:``); problems 1, 3, 16 and 29 appear 4, 3, 2
  and 2 times so deduplication has work to do; one answer is negative (-50).
- ``aime_fixture.jsonl``: 6 AIME-style problems (answers 0-999), same schema, ``data_source`` ``"aime-2024"``
  standing in for the AIME-2024 evaluation file, integer ``extra_info.index`` 0-5.
"""

from __future__ import annotations

from pathlib import Path

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
DAPO_MATH_FIXTURE = FIXTURES_DIR / "dapo_math_fixture.jsonl"
AIME_FIXTURE = FIXTURES_DIR / "aime_fixture.jsonl"
