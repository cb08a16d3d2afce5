"""A generated knowledge base of invented people, cities and countries, and questions over it.

The default data of the search agent: nothing to download, and no question can be answered from a
model's prior knowledge, since every name is invented. Each question needs one search ("Where was X
born?") or two ("What is the capital of the country where X was born?": X's page names the city,
the city's page names the country and its capital). It is generated from a fixed seed, so the corpus
the retrieval server indexes and the questions the dataset serves always agree, whatever the run's seed.

    kb = knowledge_base()
    kb.corpus     [{"id", "title", "contents"}, ...]   contents = '"<title>"\\n<text>' (the wiki-18 layout)
    kb.questions  {"train": [{"question", "answer": [str], "hops", "entity", "kind", "searches"}, ...], "test": [...]}
    kb.facts      {title: {"city"?, "year"?, "country", "capital"}}   what each page says (people, cities, countries)

`entity` is the name the question asks about, `kind` the fact asked (city, year, country, capital) and
`searches` the queries that find it (the entity, then for two hops the city its page names): the warm start of
the search agent writes its episodes from them (`warm_start/search.py`).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

KB_SEED = 0
NUM_COUNTRIES = 24
CITIES_PER_COUNTRY = 4
NUM_PEOPLE = 400
TEST_SHARE = 0.15

_SYLLABLES = ["ka", "lo", "mir", "ven", "tar", "sel", "dor", "quin", "ri", "an", "el", "os", "bra", "gel", "zo",
              "fen", "lis", "mor", "tha", "vi", "nu", "pel", "cor", "dra", "is", "um", "ber", "sha", "tol", "wen"]
_OCCUPATIONS = ["painter", "chemist", "poet", "engineer", "sailor", "composer", "architect", "historian",
                "astronomer", "weaver", "physician", "cartographer"]


@dataclass(frozen=True)
class KnowledgeBase:
    corpus: list[dict[str, str]]
    questions: dict[str, list[dict[str, Any]]]
    facts: dict[str, dict[str, str]]

    def fact(self, entity: str, kind: str) -> str:
        """What `entity`'s pages answer to `kind` (a person's country or capital through their city)."""
        facts = self.facts[entity]
        return facts[kind] if kind in facts else self.facts[facts["city"]][kind]


def _document(index: int, title: str, text: str) -> dict[str, str]:
    return {"id": f"kb-{index:05d}", "title": title, "contents": f'"{title}"\n{text}'}


class _Names:
    """Invented names, never the same twice across people and places."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def __call__(self, syllables: tuple[int, int]) -> str:
        while True:
            name = "".join(self.rng.choice(_SYLLABLES) for _ in range(self.rng.randint(*syllables))).capitalize()
            if name not in self.used:
                self.used.add(name)
                return name


@functools.lru_cache(maxsize=1)
def knowledge_base() -> KnowledgeBase:
    rng = random.Random(KB_SEED)
    name = _Names(rng)
    corpus: list[dict[str, str]] = []
    questions: list[dict[str, Any]] = []
    facts: dict[str, dict[str, str]] = {}
    cities: list[tuple[str, str, str]] = []  # (city, country, capital)
    for _ in range(NUM_COUNTRIES):
        country = name((2, 3))
        members = [name((2, 3)) for _ in range(CITIES_PER_COUNTRY)]
        capital = members[0]
        corpus.append(_document(len(corpus), country, f"{country} is a country whose capital is {capital}."))
        questions.append({"question": f"What is the capital of {country}?", "answer": [capital], "hops": 1,
                          "entity": country, "kind": "capital", "searches": [country]})
        facts[country] = {"country": country, "capital": capital}
        for city in members:
            role = "the capital" if city == capital else "a city"
            corpus.append(_document(len(corpus), city,
                                    f"{city} is {role} of {country}, a country whose capital is {capital}."))
            cities.append((city, country, capital))
            facts[city] = {"country": country, "capital": capital}
    for _ in range(NUM_PEOPLE):
        person = f"{name((1, 2))} {name((2, 3))}"
        city, country, capital = rng.choice(cities)
        year = rng.randint(1700, 1990)
        occupation = rng.choice(_OCCUPATIONS)
        article = "an" if occupation[0] in "aeiou" else "a"
        corpus.append(_document(len(corpus), person, f"{person} was {article} {occupation} born in {city} in {year}."))
        facts[person] = {"city": city, "year": str(year)}
        one, two = {"entity": person, "searches": [person]}, {"entity": person, "searches": [person, city]}
        questions.append(rng.choice([
            {"question": f"In which city was {person} born?", "answer": [city], "hops": 1, "kind": "city", **one},
            {"question": f"In what year was {person} born?", "answer": [str(year)], "hops": 1, "kind": "year",
             **one},
            {"question": f"In which country was {person} born?", "answer": [country], "hops": 2, "kind": "country",
             **two},
            {"question": f"What is the capital of the country where {person} was born?", "answer": [capital],
             "hops": 2, "kind": "capital", **two},
        ]))
    rng.shuffle(questions)
    n_test = round(len(questions) * TEST_SHARE)
    return KnowledgeBase(corpus=corpus, questions={"test": questions[:n_test], "train": questions[n_test:]},
                         facts=facts)
