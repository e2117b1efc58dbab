"""A seeded synthetic English-like byte corpus with structure a small model can learn.

Words are built from syllables and belong to classes (determiners, adjectives, nouns, verbs,
adverbs, prepositions); sentences follow a handful of templates, word frequencies are Zipfian,
and sentences are capitalised and end with punctuation. A few MB generate in well under a second.
"""

from __future__ import annotations

import functools

import numpy as np

_ONSETS = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "br", "ch", "cl", "dr", "gr", "pl", "sh", "st", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "oo"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "st"]

_TEMPLATES = [
    "D A N V D N .",
    "D N V P D A N .",
    "D N R V .",
    "D A N V D N P D N .",
    "P D N , D N V .",
    "D N V D A N ?",
    "D N V R !",
]


def _make_words(rng: np.random.Generator, count: int) -> list[str]:
    words: set[str] = set()
    while len(words) < count:
        syllables = rng.integers(1, 4)
        words.add("".join(
            _ONSETS[rng.integers(len(_ONSETS))] + _VOWELS[rng.integers(len(_VOWELS))]
            + _CODAS[rng.integers(len(_CODAS))]
            for _ in range(syllables)
        ))
    return sorted(words)


def _zipf(count: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, count + 1)
    return weights / weights.sum()


@functools.lru_cache(maxsize=4)
def generate_corpus(seed: int = 0, num_sentences: int = 60_000) -> bytes:
    """Deterministic ASCII text (about 40 bytes per sentence) for a given seed."""
    rng = np.random.default_rng(seed)
    classes = {
        "D": ["the", "a", "this", "that", "every", "some"],
        "A": _make_words(rng, 60),
        "N": _make_words(rng, 300),
        "V": [w + "s" for w in _make_words(rng, 120)],
        "R": [w + "ly" for w in _make_words(rng, 40)],
        "P": ["in", "on", "under", "with", "near", "over"],
    }
    template_ids = rng.integers(len(_TEMPLATES), size=num_sentences)
    slots = {
        cls: iter(rng.choice(len(words), size=num_sentences * 4, p=_zipf(len(words))))
        for cls, words in classes.items()
    }
    sentences = []
    for template_id in template_ids:
        tokens = []
        for slot in _TEMPLATES[template_id].split():
            if slot in classes:
                tokens.append(classes[slot][next(slots[slot])])
            elif slot == ",":
                tokens[-1] += ","
            else:
                tokens[-1] += slot
        sentence = " ".join(tokens)
        sentences.append(sentence[0].upper() + sentence[1:])
    return " ".join(sentences).encode("ascii")
