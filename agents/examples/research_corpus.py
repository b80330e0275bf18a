"""The research agent's corpus: a fictional company directory generated from a seed, plus its search.

``build_corpus(seed, n_companies, people_per_company)`` gives, deterministically, one profile per
company (industry, headquarters city, founding year, flagship product) and one per person (company,
birth city and year, joining year, role, office extension, hobby): 40 + 160 = 200 documents by default,
ids ``doc-0000``... Each fact lives in exactly one document, so every question has one source
document: company facts only in the company profile, person facts only in the person's profile.
Names repeat across people (shared first or last names) so a search for half a name is ambiguous.

``Corpus.search`` ranks documents by BM25 (k1 = 1.2, b = 0.75) over lower-cased word tokens of title and
text; the snippet is the document's first sentence, which names the entity but holds no asked fact, so
the answer needs a ``read``.
"""

from __future__ import annotations

import functools
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field

FIRST = ["Mara", "Tomas", "Ines", "Kofi", "Lena", "Ravi", "Sofia", "Jonas", "Amara", "Pavel", "Yuki", "Elena",
         "Oskar", "Nadia", "Hugo", "Priya", "Felix", "Aiko", "Marco", "Leila", "Anton", "Zara", "Bruno", "Hana"]
LAST = ["Quill", "Brandt", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Varga", "Castell", "Nowak", "Ferreira",
        "Halvorsen", "Iyer", "Kowalczyk", "Duarte", "Sato", "Rinaldi", "Abara", "Holm", "Petrov", "Vance"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Osaka", "Porto", "Tallinn", "Lyon", "Krakow", "Quito", "Adelaide",
          "Bergen", "Dakar", "Halifax", "Izmir", "Leeds", "Malmo", "Graz", "Cusco", "Hobart", "Split"]
SYLLABLES = ["vel", "trix", "nor", "dal", "quen", "bri", "sto", "mar", "zen", "lum", "cor", "ith", "pax", "rho",
             "tal", "ven", "oro", "kin"]
INDUSTRIES = {"Robotics": "robotics", "Foods": "food processing", "Energy": "renewable energy",
              "Logistics": "freight logistics", "Textiles": "textile", "Software": "software",
              "Optics": "optical instruments", "Marine": "shipbuilding"}
PRODUCTS = ["Orion", "Kestrel", "Atlas", "Juniper", "Halcyon", "Meridian", "Cobalt", "Solstice", "Tundra",
            "Vireo", "Quasar", "Basalt", "Larkspur", "Pioneer", "Cirrus", "Ember"]
PRODUCT_KINDS = ["arm", "engine", "scanner", "platform", "lens", "loom", "turbine", "drone"]
ROLES = ["head of logistics", "senior engineer", "chief financial officer", "product designer",
         "research scientist", "sales director", "data analyst", "quality inspector", "legal counsel",
         "operations manager", "marketing lead", "security officer"]
HOBBIES = ["sailing", "chess", "pottery", "rock climbing", "birdwatching", "beekeeping", "fencing", "origami",
           "cycling", "choir singing", "astronomy", "woodworking"]

_WORD = re.compile(r"[a-z0-9]+")


def tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str

    @property
    def snippet(self) -> str:
        return self.text.split(". ", 1)[0].rstrip(".") + "."


@dataclass(frozen=True)
class Question:
    """A question, its short answer and the one document that holds it."""

    id: str
    question: str
    answer: str
    doc_id: str
    kind: str


@dataclass
class Corpus:
    documents: dict[str, Document]
    questions: list[Question]
    _index: dict[str, Counter] = field(default_factory=dict, repr=False)
    _df: Counter = field(default_factory=Counter, repr=False)
    _avg_len: float = 1.0

    def __post_init__(self) -> None:
        for doc in self.documents.values():
            self._index[doc.id] = Counter(tokens(doc.title + " " + doc.text))
            self._df.update(set(self._index[doc.id]))
        self._avg_len = sum(sum(c.values()) for c in self._index.values()) / max(1, len(self._index))

    def search(self, query: str, k: int = 5) -> list[dict[str, str]]:
        """Top-``k`` documents for ``query`` by BM25: ``[{doc_id, title, snippet}]`` (empty if nothing matches)."""
        terms = tokens(query)
        n = len(self._index)
        scores: list[tuple[float, str]] = []
        for doc_id, tf in self._index.items():
            length = sum(tf.values())
            score = 0.0
            for t in terms:
                if tf[t]:
                    idf = math.log(1 + (n - self._df[t] + 0.5) / (self._df[t] + 0.5))
                    score += idf * tf[t] * 2.2 / (tf[t] + 1.2 * (0.25 + 0.75 * length / self._avg_len))
            if score > 0:
                scores.append((score, doc_id))
        scores.sort(key=lambda x: (-x[0], x[1]))
        return [{"doc_id": d, "title": self.documents[d].title, "snippet": self.documents[d].snippet}
                for _, d in scores[:k]]

    def read(self, doc_id: str) -> Document | None:
        return self.documents.get(doc_id.strip())


def _company_names(rng: random.Random, n: int) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    seen = set()
    industries = list(INDUSTRIES)
    while len(out) < n:
        stem = (rng.choice(SYLLABLES) + rng.choice(SYLLABLES)).capitalize()
        if stem in seen:
            continue
        seen.add(stem)
        out.append((f"{stem} {industries[len(out) % len(industries)]}", industries[len(out) % len(industries)]))
    return out


@functools.lru_cache(maxsize=8)
def build_corpus(seed: int = 0, n_companies: int = 40, people_per_company: int = 4) -> Corpus:
    """The directory for ``seed`` (cached): companies first, then their people."""
    if n_companies < 1 or people_per_company < 0 or n_companies * (1 + people_per_company) > 2000:
        raise ValueError("corpus needs 1+ companies and at most 2000 documents")
    if n_companies * people_per_company > len(FIRST) * len(LAST):
        raise ValueError(f"at most {len(FIRST) * len(LAST)} distinct people")
    rng = random.Random(f"research-corpus/{seed}")
    docs: dict[str, Document] = {}
    questions: list[Question] = []

    def add(title: str, text: str) -> str:
        doc_id = f"doc-{len(docs):04d}"
        docs[doc_id] = Document(doc_id, title, text)
        return doc_id

    def ask(doc_id: str, kind: str, question: str, answer: str) -> None:
        questions.append(Question(f"q-{doc_id}-{kind}", question, answer, doc_id, kind))

    companies = _company_names(rng, n_companies)
    products = rng.sample([f"{p} {k}" for p in PRODUCTS for k in PRODUCT_KINDS], n_companies)
    for (name, industry), product in zip(companies, products):
        city, founded, staff = rng.choice(CITIES), rng.randint(1950, 2015), rng.randint(40, 9000)
        doc_id = add(f"Company profile: {name}",
                     f"{name} is a {INDUSTRIES[industry]} company. It has its headquarters in {city}. "
                     f"It was founded in {founded} and employs {staff:,} people. "
                     f"Its flagship product is the {product}.")
        ask(doc_id, "hq", f"In which city is {name} headquartered?", city)
        ask(doc_id, "founded", f"In what year was {name} founded?", str(founded))
        ask(doc_id, "product", f"What is the flagship product of {name}?", product)

    people = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], n_companies * people_per_company)
    extensions = rng.sample(range(1000, 10000), len(people))
    for i, (person, ext) in enumerate(zip(people, extensions)):
        company = companies[i % n_companies][0]
        city, born = rng.choice(CITIES), rng.randint(1955, 2000)
        joined = rng.randint(max(born + 20, 1990), 2024)
        role, hobby = rng.choice(ROLES), rng.choice(HOBBIES)
        doc_id = add(f"Staff profile: {person}",
                     f"{person} is a member of staff at {company}. They were born in {city} in {born}. "
                     f"They joined the company in {joined} and work as {role}. "
                     f"Their office extension is {ext}. Outside work they enjoy {hobby}.")
        ask(doc_id, "born_city", f"In which city was {person} born?", city)
        ask(doc_id, "joined", f"In what year did {person} join {company}?", str(joined))
        ask(doc_id, "role", f"What is the job of {person} at {company}?", role)
        ask(doc_id, "extension", f"What is the office extension of {person}?", str(ext))
        ask(doc_id, "hobby", f"What does {person} enjoy doing outside work?", hobby)
    return Corpus(docs, questions)
