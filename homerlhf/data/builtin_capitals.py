"""The builtin real-model task: "What is the capital of Kenya?", with a reward a person can check.

Made for a pretrained checkpoint (``builtin:gemma3-270m``): the answers are facts the model may know
from pretraining, so a held-out country measures what a run taught about answering, not which
capitals it saw. 48 countries train, 16 others are held out (:data:`CAPITALS`, the last 16).

:func:`reward` (``reward.function: builtin:capitals``) is 1 when the answer names the country's capital
as a word anywhere (any case), 0.3 when it answers in the question's form ("the capital of Kenya is ...") with
another city, else 0: a base checkpoint rarely names a capital in a few tokens, and a group whose
answers all score 0 teaches GRPO nothing, so the partial credit gives groups a spread.

Datasets (:mod:`homerlhf.data.read`): ``builtin:capitals`` and ``builtin:capitals-heldout`` (prompts
with ``country`` and ``answer``), ``builtin:capitals-sft`` (prompt/completion records, training
countries), ``builtin:capitals-pairs`` and ``builtin:capitals-pairs-heldout`` (chosen: the right
capital in a sentence; rejected: the same sentence with another country's capital).
"""

from __future__ import annotations

import re
from typing import Any, Optional

# (country, capital): capitals that are one unambiguous city name. The last N_HELD_OUT are held out.
CAPITALS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
    ("Egypt", "Cairo"), ("Russia", "Moscow"), ("China", "Beijing"), ("Greece", "Athens"), ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Austria", "Vienna"), ("Hungary", "Budapest"), ("Poland", "Warsaw"),
    ("Czechia", "Prague"), ("Belgium", "Brussels"), ("Netherlands", "Amsterdam"), ("Peru", "Lima"),
    ("Chile", "Santiago"), ("Argentina", "Buenos Aires"), ("Colombia", "Bogota"), ("Venezuela", "Caracas"),
    ("Cuba", "Havana"), ("Mexico", "Mexico City"), ("Canada", "Ottawa"), ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"), ("Philippines", "Manila"), ("South Korea", "Seoul"),
    ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Syria", "Damascus"), ("Lebanon", "Beirut"), ("Jordan", "Amman"),
    ("Saudi Arabia", "Riyadh"), ("Kenya", "Nairobi"), ("Ethiopia", "Addis Ababa"), ("Nigeria", "Abuja"),
    ("Ghana", "Accra"), ("Morocco", "Rabat"), ("Algeria", "Algiers"), ("Tunisia", "Tunis"), ("Senegal", "Dakar"),
    # held out
    ("United Kingdom", "London"), ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Iceland", "Reykjavik"), ("Turkey", "Ankara"),
    ("India", "New Delhi"), ("Pakistan", "Islamabad"), ("Afghanistan", "Kabul"), ("Nepal", "Kathmandu"),
    ("Uganda", "Kampala"), ("Sudan", "Khartoum"), ("Ecuador", "Quito"), ("Uruguay", "Montevideo"),
]
N_HELD_OUT = 16
QUESTION = "What is the capital of {country}?"
ANSWER = "The capital of {country} is {capital}."
PARTIAL = 0.3  # an answer in the question's form with another city


def _countries(held_out: bool) -> list[tuple[str, str]]:
    return CAPITALS[-N_HELD_OUT:] if held_out else CAPITALS[:-N_HELD_OUT]


def prompt_records(held_out: bool = False) -> list[dict[str, str]]:
    """``{"prompt", "country", "answer"}`` rows of the training (or held-out) countries."""
    return [{"prompt": QUESTION.format(country=c), "country": c, "answer": a} for c, a in _countries(held_out)]


def sft_records() -> list[dict[str, str]]:
    """Prompt/completion rows on the training countries, each answer one sentence naming the capital."""
    return [{"prompt": QUESTION.format(country=c), "completion": ANSWER.format(country=c, capital=a)}
            for c, a in _countries(False)]


def preference_records(held_out: bool = False) -> list[dict[str, str]]:
    """Chosen: the right capital in a sentence; rejected: the same sentence naming the capital of the
    country 7 places further down the same list (never the right one)."""
    rows = _countries(held_out)
    out = []
    for i, (country, capital) in enumerate(rows):
        wrong = rows[(i + 7) % len(rows)][1]
        out.append({"prompt": QUESTION.format(country=country),
                    "chosen": ANSWER.format(country=country, capital=capital),
                    "rejected": ANSWER.format(country=country, capital=wrong)})
    return out


def score(response: str, country: str, capital: str) -> float:
    """1.0 when ``response`` names ``capital`` as a word of its own (any case: "Tunis", not the start of
    "Tunisia"); :data:`PARTIAL` when it says "the capital of <country> is" with another city; else 0.0."""
    text = response.lower()
    if re.search(rf"\b{re.escape(capital.lower())}\b", text):
        return 1.0
    return PARTIAL if f"capital of {country.lower()} is" in text else 0.0


def reward(response: str, row: dict[str, Any]) -> Optional[float]:
    """``reward.function: builtin:capitals``: :func:`score` against the row's ``country`` and ``answer``;
    None (no reward) for a row without them, e.g. a prompt typed in the app."""
    if row.get("answer") is None or row.get("country") is None:
        return None
    return score(response, row["country"], row["answer"])
