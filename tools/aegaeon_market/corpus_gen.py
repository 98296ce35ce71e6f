"""Generate the tokenizer training corpus from our own templates.

The market's tokenizers are trained on ``corpus/corpus.txt``, which ships with
the package. This module is how that file was made (``python -m
aegaeon_market.corpus_gen``): the hand-written ``corpus/passages.txt`` followed
by seeded, template-generated everyday prose, dialogue, chat turns,
instructions, numbers and a little code. The word lists (``corpus/words.json``)
and sentence templates (``corpus/templates.json``: slots in braces are filled by
:class:`Slots`; a trailing digit makes a second, independent value of the same
kind, ``{name2}``) are plain data written for this project; the word lists are
long on purpose: a byte-level BPE with 8k tokens needs a few thousand distinct
words to learn merges that look like a real English tokenizer's. Generation is
deterministic, so the shipped file can be re-derived and checked.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

CORPUS_DIR = Path(__file__).parent / "corpus"


def _lists(name: str) -> Any:
    """A JSON file of named lists as attributes of tuples (a list item a tuple too)."""
    data = json.loads((CORPUS_DIR / name).read_text(encoding="utf-8"))
    return SimpleNamespace(**{k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
                              for k, v in data.items()})  # fmt: skip


w = _lists("words.json")
texts = _lists("templates.json")
CORPUS_SEED = 2025
CORPUS_CHARS = 1_600_000

_UNCOUNTABLE = frozenset({"bread", "butter", "cheese", "coffee", "sugar", "rain", "paper", "fire"})
_PLURAL_SPECIAL = {"child": "children", "leaf": "leaves", "shelf": "shelves", "person": "people",
                   "scissors": "scissors"}
_MINUTES = (0, 10, 15, 20, 30, 40, 45, 50)
_VOWEL_SOUND_EXCEPTIONS = {"university": "a", "hour": "an", "honest": "an", "honesty": "an"}


def plural(noun: str) -> str:
    """English plural for the lexicon's nouns (the lexicon avoids hard cases)."""
    if noun in _PLURAL_SPECIAL:
        return _PLURAL_SPECIAL[noun]
    if noun in _UNCOUNTABLE:
        return noun
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def article(word: str) -> str:
    """``a`` or ``an`` followed by the word."""
    art = _VOWEL_SOUND_EXCEPTIONS.get(word, "an" if word[0] in "aeiou" else "a")
    return f"{art} {word}"


def inflect(base: str) -> tuple[str, str, str]:
    """(past, -ing, third person) of a regular verb."""
    if base.endswith("e"):
        past, ing = base + "d", (base + "ing" if base.endswith("ee") else base[:-1] + "ing")
    elif base.endswith("y") and base[-2] not in "aeiou":
        past, ing = base[:-1] + "ied", base + "ing"
    else:
        past, ing = base + "ed", base + "ing"
    if base.endswith(("s", "sh", "ch", "x", "z", "o")):
        third = base + "es"
    elif base.endswith("y") and base[-2] not in "aeiou":
        third = base[:-1] + "ies"
    else:
        third = base + "s"
    return past, ing, third


_VERBS: tuple[tuple[str, str, str, str], ...] = tuple(
    [(b, p, i, inflect(b)[2]) for b, p, i in w.IRREGULAR_VERBS]
    + [(b, *inflect(b)) for b in w.REGULAR_VERBS]
)


# slots filled with a word of one list (words.json), and with a form of the verb drawn
_WORDS = {"name": "FIRST_NAMES", "thing": "THINGS", "adj": "ADJECTIVES", "idea": "IDEAS",
          "adverb": "ADVERBS", "feeling": "FEELINGS", "job": "JOBS", "animal": "ANIMALS",
          "food": "FOODS", "color": "COLORS", "weather": "WEATHER", "weekday": "WEEKDAYS",
          "month": "MONTHS", "intl": "NON_ASCII", "cverb": "CODE_VERBS", "cnoun": "CODE_NOUNS"}
_VERB_FORMS = ("verb", "past", "ing", "third")


class Slots(dict[str, str]):
    """Fills template slots on first use, so a slot repeats within one template."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    def __missing__(self, key: str) -> str:
        value = self._make(key.rstrip("0123456789"))
        self[key] = value
        return value

    def _make(self, kind: str) -> str:
        r = self.rng
        verb = r.choice(_VERBS)
        if kind in _VERB_FORMS:
            return verb[_VERB_FORMS.index(kind)]
        if kind in _WORDS:
            return str(r.choice(getattr(w, _WORDS[kind])))
        makers: dict[str, Callable[[], str]] = {
            "full": lambda: f"{r.choice(w.FIRST_NAMES)} {r.choice(w.FAMILY_NAMES)}",
            "town": lambda: r.choice(w.TOWN_HEADS) + r.choice(w.TOWN_TAILS),
            "things": lambda: plural(r.choice(w.THINGS)),
            "a_thing": lambda: article(r.choice(w.THINGS)),
            "a_adj": lambda: article(r.choice(w.ADJECTIVES)),
            "ideas": lambda: plural(r.choice(w.IDEAS)),
            "a_job": lambda: article(r.choice(w.JOBS)),
            "cap_thing": lambda: r.choice(w.THINGS).capitalize(),
            "day": lambda: str(r.randint(1, 28)),
            "year": lambda: str(r.randint(1950, 2031)),
            "num": lambda: str(r.choice((2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 30, 45, 90))),
            "big": lambda: f"{r.randint(100, 99_999):,}",
            "time": lambda: f"{r.randint(5, 22):02d}:{r.choice(_MINUTES):02d}",
            "price": lambda: f"{r.randint(1, 240)}.{r.randint(0, 99):02d}",
            "pct": lambda: f"{r.randint(1, 99)}%",
            "temp": lambda: str(r.choice((160, 170, 180, 190, 200, 220))),
        }
        return makers[kind]()


def fill(template: str, rng: random.Random) -> str:
    """One template with fresh slot values, first letter capitalised."""
    text = template.format_map(Slots(rng))
    return text[:1].upper() + text[1:]


def _sentences(rng: random.Random, pool: tuple[str, ...], lo: int, hi: int) -> str:
    return " ".join(fill(rng.choice(pool), rng) for _ in range(rng.randint(lo, hi)))


def story(rng: random.Random) -> str:
    """A paragraph or two of everyday prose."""
    paras = [_sentences(rng, texts.STORY, 3, 8) for _ in range(rng.randint(1, 3))]
    return "\n\n".join(paras)


def dialogue(rng: random.Random) -> str:
    """A short quoted exchange between two people."""
    slots = Slots(rng)
    lines = []
    for turn in range(rng.randint(2, 6)):
        speaker, listener = ("{name}", "{name2}") if turn % 2 == 0 else ("{name2}", "{name}")
        line = rng.choice(texts.LINES).format_map(slots)
        line = line[:1].upper() + line[1:]
        tag = rng.choice(("said", "asked", "replied", "added", "laughed", "whispered"))
        lines.append(f"\u201c{line}\u201d {tag} {speaker.format_map(slots)}."
                     if rng.random() < 0.6 else f"\"{line}\" {listener.format_map(slots)} said.")
    return "\n".join(lines)


def chat(rng: random.Random) -> str:
    """A user/assistant exchange, the shape chat prompts take."""
    question = fill(rng.choice(texts.QUESTIONS), rng)
    steps = [fill(rng.choice(texts.STEPS), rng) for _ in range(rng.randint(2, 5))]
    answer = " ".join([fill(rng.choice(texts.OPENERS), rng), *steps])
    return f"User: {question}\nAssistant: {answer}"


def recipe(rng: random.Random) -> str:
    """A recipe: title, ingredients with quantities, numbered steps."""
    slots = Slots(rng)
    title = fill("{adj} {food} with {food2} and {food3}", rng)
    items = []
    for _ in range(rng.randint(3, 7)):
        long_name, short_name, lo, hi = rng.choice(w.UNITS)
        unit = rng.choice((long_name, short_name))
        items.append(f"- {rng.randint(lo, hi)} {unit} {rng.choice(w.FOODS)}")
    steps = [f"{i}. {fill(rng.choice(texts.RECIPE_STEPS), rng)}"
             for i in range(1, rng.randint(4, 8))]
    serves = f"Serves {rng.randint(2, 8)}. Ready in {slots['num']} minutes."
    return "\n".join([title.title(), serves, "", "Ingredients:", *items, "", "Method:", *steps])


def numbers(rng: random.Random) -> str:
    """Timetables, receipts, dates and sums."""
    lines = [fill(rng.choice(texts.NUMBER_LINES), rng) for _ in range(rng.randint(2, 6))]
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    lines.append(rng.choice((f"{a} + {b} = {a + b}", f"{a} times {b} is {a * b}.",
                             f"{a * b} divided by {b} is {a}.", f"{a + b} - {b} = {a}")))
    return "\n".join(lines)


def code(rng: random.Random) -> str:
    """A small Python, shell or JSON snippet."""
    # Templates escape literal braces as {{ and }} (str.format rules).
    return str(rng.choice(texts.CODE).format_map(Slots(rng)))


def letter(rng: random.Random) -> str:
    """A short note or email."""
    slots = Slots(rng)
    body = _sentences(rng, texts.LETTER, 2, 5)
    sign = rng.choice(("Best wishes", "Kind regards", "Thanks again", "See you soon", "Cheers"))
    return "Dear {name},\n\n".format_map(slots) + body + f"\n\n{sign},\n" + slots["name2"]


_KINDS: tuple[tuple[Callable[[random.Random], str], int], ...] = (
    (story, 30), (dialogue, 14), (chat, 14), (recipe, 8), (numbers, 10), (code, 10), (letter, 8),
)


def generate(seed: int = CORPUS_SEED, num_chars: int = CORPUS_CHARS) -> str:
    """The whole corpus: hand-written passages, then generated blocks."""
    rng = random.Random(seed)
    blocks = [(CORPUS_DIR / "passages.txt").read_text(encoding="utf-8").strip()]
    size = len(blocks[0])
    makers = [k for k, _ in _KINDS]
    weights = [n for _, n in _KINDS]
    while size < num_chars:
        block = rng.choices(makers, weights)[0](rng)
        blocks.append(block)
        size += len(block) + 2
    return "\n\n".join(blocks) + "\n"


def main() -> int:
    """Write ``corpus/corpus.txt`` (or the path given as the first argument)."""
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else CORPUS_DIR / "corpus.txt"
    out.write_text(generate(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
