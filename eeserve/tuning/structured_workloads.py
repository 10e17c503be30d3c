"""Structured-output workloads: extraction into a schema, classification by choice (the
structured benchmark and constrained calibration run them).

Contract: ``extraction(n)`` and ``classification(n)`` return a ``Workload``: ``n`` chat prompts
(one user message each), the ``StructuredOutputsParams`` every request is constrained by, the
answer each text states (``truth``), and how to score an output (``valid``: it parses and holds
its constraint; ``fields``: the values compared field by field). The texts are made from fixed
lists by a seeded generator, so every run and every engine sees the same prompts.

- Extraction: a sentence or two about a person -> an object of six fields: a string, an integer,
  an enum of five roles, a nullable string, a boolean and a string (``PERSON``).
- Classification: a short message -> one of five labels (``guided_choice``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from eeserve.structured_outputs import StructuredOutputsParams

ROLES = ["engineer", "doctor", "teacher", "artist", "lawyer"]
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ROLES},
        "email": {"type": ["string", "null"], "maxLength": 60},
        "remote": {"type": "boolean"},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "role", "email", "remote", "city"],
    "additionalProperties": False,
}
LABELS = ["sports", "politics", "technology", "health", "business"]

_FIRST = ["Maria", "Tom", "Ken", "Anna", "Luis", "Priya", "Omar", "Chloe", "Ivan", "Grace"]
_LAST = ["Lopez", "Walsh", "Ito", "Berg", "Garcia", "Nair", "Haddad", "Martin", "Petrov", "Kim"]
_CITIES = ["Madrid", "Dublin", "Osaka", "Oslo", "Lima", "Pune", "Cairo", "Lyon", "Kyiv", "Seoul"]
_ROLE_WORDS = {
    "engineer": ["an engineer", "a software engineer", "a civil engineer"],
    "doctor": ["a doctor", "a physician", "a surgeon"],
    "teacher": ["a teacher", "a maths teacher", "a primary school teacher"],
    "artist": ["an artist", "a painter", "a sculptor"],
    "lawyer": ["a lawyer", "an attorney", "a solicitor"],
}
_TOPICS = {
    "sports": ["the final whistle", "a hat-trick in the derby", "the marathon record",
               "the tennis open", "the league table"],
    "politics": ["the parliament vote", "the new coalition", "the election debate",
                 "the minister's resignation", "the senate bill"],
    "technology": ["the new smartphone chip", "a cloud outage", "the open-source compiler",
                   "a faster database", "the chatbot release"],
    "health": ["the flu vaccine", "a study on sleep", "the hospital waiting lists",
               "a new diabetes drug", "daily exercise and the heart"],
    "business": ["quarterly earnings", "the merger talks", "the stock market rally",
                 "a startup's funding round", "rising interest rates"],
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    prompts: list[list[dict[str, str]]]  # one conversation per request
    constraint: StructuredOutputsParams
    truth: list[dict[str, Any]]  # per prompt, the fields its text states
    valid: Callable[[str], bool]
    fields: Callable[[str], dict[str, Any] | None]  # None: the output does not parse


def _person(rng: random.Random) -> tuple[str, dict[str, Any]]:
    name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    age, city, role = rng.randint(21, 70), rng.choice(_CITIES), rng.choice(ROLES)
    address = f"{name.split()[0].lower()}@{rng.choice(['mail.com', 'work.org'])}"
    email = address if rng.random() < 0.6 else None
    remote = rng.random() < 0.5
    role_text = rng.choice(_ROLE_WORDS[role])
    where = "works from home" if remote else "goes to the office every day"
    contact = f" Contact: {email}." if email else " No email address is known."
    text = rng.choice(
        [
            f"{name}, {age}, is {role_text} in {city} and {where}.{contact}",
            f"Meet {name} from {city}: {role_text}, aged {age}, who {where}.{contact}",
            f"{name} ({age}) lives in {city}. Job: {role_text}; {where}.{contact}",
        ]
    )
    truth = dict(name=name, age=age, role=role, email=email, remote=remote, city=city)
    return text, truth


def _parsed(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _schema_valid(text: str) -> bool:
    value = _parsed(text)
    if value is None:
        return False
    try:
        jsonschema.validate(value, PERSON)
    except jsonschema.ValidationError:
        return False
    return True


def extraction(n: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    people = [_person(rng) for _ in range(n)]
    ask = (
        "Extract the person as JSON with the fields name, age, role (one of "
        f"{', '.join(ROLES)}), email (null if unknown), remote (true if they work from home) "
        "and city.\n\n"
    )
    return Workload(
        name="extraction",
        prompts=[[{"role": "user", "content": ask + text}] for text, _ in people],
        constraint=StructuredOutputsParams(json=PERSON),
        truth=[t for _, t in people],
        valid=_schema_valid,
        fields=_parsed,
    )


def classification(n: int, seed: int = 0) -> Workload:
    rng = random.Random(seed + 1)
    labels = [LABELS[i % len(LABELS)] for i in range(n)]
    rng.shuffle(labels)
    texts = [
        rng.choice(["Breaking: ", "Today's note: ", "Quick update: ", ""])
        + f"everyone is talking about {rng.choice(_TOPICS[label])}."
        for label in labels
    ]
    ask = f"Classify the message into one topic: {', '.join(LABELS)}. Answer with the topic.\n\n"
    return Workload(
        name="classification",
        prompts=[[{"role": "user", "content": ask + t}] for t in texts],
        constraint=StructuredOutputsParams(choice=LABELS),
        truth=[{"label": label} for label in labels],
        valid=lambda text: text in LABELS,
        fields=lambda text: {"label": text},
    )


def field_agreement(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float:
    """Fraction of ``b``'s fields whose value ``a`` has too (0 when either does not parse)."""
    if not a or not b:
        return 0.0
    return sum(a.get(k) == v for k, v in b.items()) / len(b)
