"""Built-in rewards: ``exact_numeric``, ``tool_format``, ``exact_match`` (the math rewards,
``boxed_math`` and ``math_verify``, are in ``math_grader``), and the answer parsing they share.

Answer rewards score 1.0 or 0.0 and report ``answer_found`` (whether an answer could be
extracted at all), which separates "wrong" from "badly formatted" on a dashboard. A missing
or unparseable ground truth is a data error: the reward raises, and ``compute_reward``
records it as a 0.0 with the error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from .registry import RewardInput, RewardOutput, register_reward

# -- numbers ----------------------------------------------------------------------------------
# A sign only where it cannot be a binary minus ("3-5" is 3 and 5); thousands groups only when
# exactly three digits follow each comma ("1,2,3" is three numbers, "12,3456" two); ".5" is 0.5.
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<!\d)\.\d+)")


MAX_EXACT_DIGITS = 4000
"""A number with more significant digits is compared as its canonical digit string: Python
refuses ``int``/``Fraction`` of more than 4,300 digits, and a reward must score such an answer
(wrong, surely), not fail on it."""

Number = Fraction | str
"""An exact number: a ``Fraction``, or the canonical digits of one too long for it."""


def exact_number(token: str) -> Number:
    """``"-1,234.50"`` as ``Fraction(-2469, 2)``; past ``MAX_EXACT_DIGITS`` significant digits the
    canonical string (``"-1234.5"``: no grouping commas, leading or trailing zeros)."""
    token = token.replace(",", "")
    sign = "-" if token.startswith("-") else ""
    whole, _, part = token.lstrip("+-").partition(".")
    whole, part = whole.lstrip("0"), part.rstrip("0")
    if len(whole) + len(part) <= MAX_EXACT_DIGITS:
        return Fraction(f"{sign}{whole or 0}.{part or 0}")
    return f"{sign}{whole or 0}" + (f".{part}" if part else "")


def parse_last_number(text: str) -> Number | None:
    """The last number in ``text``, exact (``"-1,234.5"`` → ``Fraction(-2469, 2)``, see ``exact_number``), or None."""
    matches = _NUMBER.findall(text.replace("\u2212", "-"))  # U+2212 MINUS SIGN
    return exact_number(matches[-1]) if matches else None


def _truth(inp: RewardInput, reward: str) -> str:
    if inp.ground_truth is None:
        raise ValueError(f"{reward} needs a ground_truth")
    return inp.ground_truth


@register_reward("exact_numeric")
def exact_numeric(inp: RewardInput) -> RewardOutput:
    """1.0 when the last number in the response equals the ground truth numerically (``57.0`` = ``57``)."""
    truth = parse_last_number(_truth(inp, "exact_numeric"))
    if truth is None:
        raise ValueError(f"exact_numeric: ground truth {inp.ground_truth!r} holds no number")
    answer = parse_last_number(inp.response_text)
    return RewardOutput(score=float(answer == truth), metrics={"answer_found": float(answer is not None)})


# -- \boxed{} math answers --------------------------------------------------------------------
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


MAX_ANSWER_CHARS = 1000
"""A boxed answer longer than this is compared as written, not normalised (no math answer is
that long; normalising one is superlinear)."""


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced, ``\\{`` skipped); None if absent or cut off."""
    found, pos = None, 0
    while (match := _BOXED.search(text, pos)) is not None:
        end = _closing_brace(text, match.end())
        if end is None:  # unbalanced: the output was truncated inside the last box
            return None
        found, pos = text[match.end() : end], end + 1
    return found


_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` closing the group whose ``{`` is just before ``start`` (braces found in C)."""
    depth = 1
    for match in _BRACE.finditer(text, start):
        char = match.group()
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return match.start()
        # an escaped character (\{, \}) never opens or closes a group
    return None


_DELETE = re.compile(r"\\?\$|\\[!,;: ]|\\(?:q?quad|left|right|displaystyle)(?![a-zA-Z])")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf|boxed)\{([^{}]*)\}")
_COMMAND = re.compile(r"\\[a-zA-Z]+")


def normalize_math_answer(answer: str) -> str:
    """A canonical string for simple LaTeX answers: ``$\\dfrac{1}{2}.$`` and ``1/2`` both give ``1/2``.

    Drops ``$``, spacing commands (``\\!``, ``\\,``, ``\\quad``…), ``\\left``/``\\right``,
    ``\\displaystyle``, all whitespace and trailing dots; unwraps ``\\text{}``, ``\\mathrm{}``
    and a nested ``\\boxed{}``; writes ``\\frac{a}{b}``, ``\\dfrac``, ``\\tfrac`` and ``\\frac12``
    as ``a/b`` (``(a)/(b)`` when a side is not a single term); keeps the right side of ``x = 5``.
    """
    s = _DELETE.sub("", answer)
    s = _TEXT.sub(r"\1", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
    s = _rewrite_fracs(s)
    s = s.rstrip(".")
    if re.fullmatch(r"[a-zA-Z]=.+", s):
        s = s[2:]
    return s


def _rewrite_fracs(s: str) -> str:
    out: list[str] = []
    i = 0
    while (j := s.find("\\frac", i)) != -1:
        out.append(s[i:j])
        pos = j + len("\\frac")
        num = _frac_arg(s, pos)
        den = _frac_arg(s, num[1]) if num is not None else None
        if num is None or den is None:  # malformed: keep the text as written
            out.append("\\frac")
            i = pos
            continue
        a, b = _rewrite_fracs(num[0]), _rewrite_fracs(den[0])
        out.append(f"{a}/{b}" if _is_term(a) and _is_term(b) else f"({a})/({b})")
        i = den[1]
    out.append(s[i:])
    return "".join(out)


def _is_term(s: str) -> bool:
    """No operator outside braces and parentheses (a leading minus allowed): ``\\sqrt{2}`` yes, ``1+x`` no."""
    depth = 0
    for char in s.removeprefix("-"):
        if char in "{(":
            depth += 1
        elif char in "})":
            depth -= 1
        elif depth == 0 and char in "+-*/=,":
            return False
    return bool(s)


def _frac_arg(s: str, pos: int) -> tuple[str, int] | None:
    """One argument of ``\\frac`` at ``pos``: a ``{group}`` or a single character (``\\frac12``)."""
    if pos >= len(s) or s[pos] == "}":
        return None
    if s[pos] == "{":
        end = _closing_brace(s, pos + 1)
        return None if end is None else (s[pos + 1 : end], end + 1)
    if (command := _COMMAND.match(s, pos)) is not None:  # \frac\pi2
        return command.group(), command.end()
    return None if s[pos] == "\\" else (s[pos], pos + 1)


_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+")


def _as_number(s: str) -> Fraction | None:
    """``s`` as an exact number when it is one: ``-3``, ``1,000``, ``0.25``, ``-1/2``, ``1.5/3``
    (None for any other text; answers are at most ``MAX_ANSWER_CHARS`` long, so digits fit)."""
    parts = s.split("/")
    if len(parts) > 2 or not all(_PLAIN_NUMBER.fullmatch(p) for p in parts):
        return None
    values = [Fraction(p.replace(",", "")) for p in parts]
    if len(values) == 2:
        return values[0] / values[1] if values[1] != 0 else None
    return values[0]


def math_answers_equal(a: str, b: str) -> bool:
    """Equal as numbers when both normalised answers parse as numbers, else as normalised strings.
    An answer longer than ``MAX_ANSWER_CHARS`` is compared as written (whitespace stripped)."""
    if len(a) > MAX_ANSWER_CHARS or len(b) > MAX_ANSWER_CHARS:
        return a.strip() == b.strip()
    a, b = normalize_math_answer(a), normalize_math_answer(b)
    x, y = _as_number(a), _as_number(b)
    return x == y if x is not None and y is not None else a == b


# -- tool use format --------------------------------------------------------------------------
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolFormat:
    """Tool-use format reward: 1.0 when all three criteria hold, else the sum of their credits.

    The criteria: the trajectory made at least one tool call; it made some and none failed;
    it ends with a final answer (the response is non-empty once thinking is removed, that is
    ``<think>`` blocks and anything before a last ``</think>``, and is not itself a
    ``<tool_call>``). With the default credits of 0 the reward
    is all or nothing; register a variant for partial credit::

        register_reward("tool_format_soft")(ToolFormat(tool_call=0.3, no_errors=0.2, final_answer=0.3))
    """

    tool_call: float = 0.0
    """Credit for calling a tool at least once."""
    no_errors: float = 0.0
    """Credit for calling tools with none failing."""
    final_answer: float = 0.0
    """Credit for ending with a non-empty final answer."""

    def __post_init__(self) -> None:
        credits = {
            "tool_call": self.tool_call,
            "no_errors": self.no_errors,
            "final_answer": self.final_answer,
        }
        for name, credit in credits.items():
            if not 0.0 <= credit <= 1.0:
                raise ValueError(f"ToolFormat.{name}: expected a credit in [0, 1], got {credit}")
        if sum(credits.values()) > 1.0:
            raise ValueError(
                f"ToolFormat: partial credits must sum to at most 1.0, got {sum(credits.values())}"
            )

    def __call__(self, inp: RewardInput) -> float:
        called = inp.num_tool_calls > 0
        clean = called and inp.tool_errors == 0
        final = _THINK.sub("", inp.response_text.rsplit("</think>", 1)[-1]).strip()
        answered = bool(final) and "<tool_call>" not in final
        if called and clean and answered:
            return 1.0
        return self.tool_call * called + self.no_errors * clean + self.final_answer * answered


tool_format = register_reward("tool_format")(ToolFormat())


# -- exact match ------------------------------------------------------------------------------
@register_reward("exact_match")
def exact_match(inp: RewardInput) -> float:
    """1.0 when the response equals the ground truth, surrounding whitespace ignored."""
    return float(inp.response_text.strip() == _truth(inp, "exact_match").strip())
