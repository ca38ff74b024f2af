"""Multiple-choice answers: the letter after the last "Answer:" (or its translation).

Used by the ``math`` environment's ``verifier_type: english_multichoice`` and
``multilingual_multichoice`` (NeMo-RL's names and prompt format: "The last line of your
response should be of the following format: 'Answer: $LETTER'"). Plain string work, run
in-process; every pattern is linear-time.

How a response is read:

1. Thinking is dropped (:func:`~envloop.environments.common.answer_extraction.after_thinking`).
2. The text is NFKC-normalised (full-width ``Ａ``/``：`` become ``A``/``:``), zero-width
   characters are dropped, and markdown and LaTeX wrappers (``**``, ``$``, ``\\boxed{``,
   ``\\text{``, braces, ...) are removed, so ``**Answer:** $\\boxed{C}$`` reads ``Answer: C``.
3. The answer is the capital letter after the LAST ``Answer:`` (any case; in multilingual
   mode also ``答案:``, ``Réponse :``, ``উত্তরঃ``, ... see :data:`ANSWER_WORDS`), optionally in
   brackets, and not followed by another letter (``Answer: Apple`` has no choice). Arabic
   ``أ ب ج د`` and Bengali ``অ ব ড ঢ`` choices read as ``A``-``D``.

Deliberate differences from NeMo-RL: the last "Answer:" counts, not the first; a lower-case
letter is not a choice (NeMo-RL extracts it but then never matches an upper-case key, and
"Answer: a number ..." would read as choice ``a``); thinking is ignored.
"""

from __future__ import annotations

import re
import unicodedata

from envloop.environments.common.answer_extraction import after_thinking, last_match

ANSWER_WORDS: tuple[str, ...] = (
    "Answer",
    *("Antwort", "Respuesta", "Risposta", "Réponse", "Resposta", "Ответ", "Cevap"),
    *("Jawaban", "Jibu", "Idahun", "Ìdáhùn", "Idáhùn", "Àdáhùn", "Đáp án", "Câu trả lời"),
    *("答案", "答复", "答曰", "答え", "回答", "解答", "答", "정답", "답변", "답"),
    *("الإجابة النهائية", "الإجابة الصحيحة هي", "الإجابة الصحيحة", "الإجابة هي", "الإجابة"),
    *("الجواب النهائي", "الجواب", "إجابة", "উত্তর", "उत्तर", "คำตอบ"),
)
"""The word for "Answer" in the languages multilingual mode reads (English mode: ``Answer``)."""

NON_LATIN_CHOICES = {"أ": "A", "ب": "B", "ج": "C", "د": "D", "অ": "A", "ব": "B", "ড": "C", "ঢ": "D"}
"""Choice letters of Arabic and Bengali option lists, as ``A``-``D``."""

_WRAPPERS = re.compile(r"\*\*|\$|\\\(|\\\)|\\(?:boxed|text|textbf|mathrm|mathbf)\{|[{}]")
_ZERO_WIDTH = re.compile("[\u200b-\u200d\u2060\ufeff]")


def _answer_pattern(words: tuple[str, ...]) -> re.Pattern[str]:
    # Longest words first, so "答案" wins over "答" at the same place.
    alternatives = "|".join(
        re.escape(unicodedata.normalize("NFKC", w)) for w in sorted(words, key=len, reverse=True)
    )
    letters = "A-Z" + "".join(NON_LATIN_CHOICES)
    return re.compile(
        rf"(?i:{alternatives})\s*[:ঃ][ \t]*[(\[]?([{letters}])(?![A-Za-z])", re.UNICODE
    )


_ENGLISH = _answer_pattern(("Answer",))
_MULTILINGUAL = _answer_pattern(ANSWER_WORDS)


def extract_choice(response: str, multilingual: bool = False) -> str | None:
    """The letter chosen after the last "Answer:" (``A``-``Z``); None when there is none.

    >>> extract_choice("Answer: A\\nOn reflection... **ANSWER:** (C)")
    'C'
    >>> extract_choice("答案：Ｂ", multilingual=True), extract_choice("答案：Ｂ")
    ('B', None)
    >>> extract_choice("Answer: a number below ten"), extract_choice("<think>Answer: B")
    (None, None)
    """
    text = _ZERO_WIDTH.sub("", unicodedata.normalize("NFKC", after_thinking(response)))
    text = _WRAPPERS.sub("", text)
    pattern = _MULTILINGUAL if multilingual else _ENGLISH
    last = last_match(pattern, text)
    return None if last is None else NON_LATIN_CHOICES.get(last.group(1), last.group(1))


def choice_key(ground_truth: str) -> str:
    """A ground-truth choice as a bare capital letter (``" (c)."`` -> ``"C"``).

    >>> choice_key(" (c)."), choice_key("Ｄ"), choice_key("ب")
    ('C', 'D', 'B')
    """
    key = unicodedata.normalize("NFKC", ground_truth).strip().strip("()[].").strip()
    return NON_LATIN_CHOICES.get(key, key.upper())


def grade_choice(
    ground_truth: str, response: str, multilingual: bool = False
) -> tuple[bool, str | None]:
    """``(correct, chosen letter or None)`` for one response.

    >>> grade_choice("C", "Reasoning...\\nAnswer: C"), grade_choice("B", "Answer: D")
    ((True, 'C'), (False, 'D'))
    """
    choice = extract_choice(response, multilingual)
    return choice is not None and choice == choice_key(ground_truth), choice
