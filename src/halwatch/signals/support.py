"""Lexical support of an answer by its context: which words, n-grams, numbers and names of the response occur in
the context. Pure functions of the two texts (no forward pass, no labels), so they do not move with the prompt's
template, length or order of passages, and they see the whole context even where the token cap cut it (up to its
last :data:`MAX_CONTEXT_CHARS` characters: :func:`halwatch.models.forward.attach_support`).

Alignment features of this kind are what span-level hallucination detectors are built around (is the token, or the
n-gram it closes, in the source); halwatch's fused detector uses them beside the white-box signals, both per answer
(:func:`answer_features`) and per response token (:func:`token_features`).
"""

from __future__ import annotations

import numpy as np

from halwatch.tokens import WORD, words

#: English function words: never counted as unsupported content.
STOPWORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being below between both
but by can could did do does doing down during each few for from further had has have having he her here hers
herself him himself his how i if in into is it its itself just me more most my myself no nor not now of off on once
only or other our ours ourselves out over own same she should so some such than that the their theirs them
themselves then there these they this those through to too under until up very was we were what when where which
while who whom why will with would you your yours yourself yourselves one two may might must shall also however
""".split())

#: The most context the support reads, from the end (the end is what the token cap keeps): 64 K characters, about
#: 16,000 tokens, 16x the default cap and 6x the longest context of every dataset in ../shared/data (10,363
#: characters). Reading a 3.9 MB context whole took 1.6 s of pure Python, which held the interpreter lock and
#: stalled the service's event loop.
MAX_CONTEXT_CHARS = 1 << 16


#: Names of the per-token features, in :func:`token_features`' column order.
TOKEN_FEATURES = ("novel_word", "novel_bigram", "novel_trigram", "novel_number", "novel_name", "content")
#: Names of the per-answer features, in :func:`answer_features`' order.
ANSWER_FEATURES = ("novel_word_share", "novel_bigram_share", "novel_trigram_share", "log_novel_numbers",
                   "log_novel_names", "log_longest_novel_run", "any_novel_number", "any_novel_name")


def _norm_number(word: str) -> str:
    return word.replace(",", "")


def _is_number(word: str) -> bool:
    return not word.isalpha() and any(map(str.isdigit, word))  # a word of letters alone: one call in C


def word_flags(context: str, response: str) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The character range of every response word and its flags ``[W, len(TOKEN_FEATURES)]`` (1 = unsupported):
    a content word absent from the context; the bigram / trigram that the word closes absent from the context's; a
    number absent from the context's numbers; a capitalised word (not the answer's first) absent from the context;
    whether the word is a content word at all."""
    ctx = [w.lower() for w in WORD.findall(context)]  # the words of words(context), without their offsets
    vocab = set(ctx)
    numbers = {_norm_number(w) for w in ctx if _is_number(w)}
    bigrams = set(zip(ctx, ctx[1:]))
    trigrams = set(zip(ctx, ctx[1:], ctx[2:]))
    found = words(response)
    flags = np.zeros((len(found), len(TOKEN_FEATURES)), dtype=np.float32)
    for k, (w, start, _) in enumerate(found):
        content = w not in STOPWORDS
        flags[k, 5] = content
        flags[k, 0] = content and w not in vocab
        flags[k, 1] = k >= 1 and (found[k - 1][0], w) not in bigrams
        flags[k, 2] = k >= 2 and (found[k - 2][0], found[k - 1][0], w) not in trigrams
        flags[k, 3] = _is_number(w) and _norm_number(w) not in numbers
        flags[k, 4] = content and k > 0 and response[start].isupper() and w not in vocab
    return [(start, end) for _, start, end in found], flags


def features(context: str, response: str, offsets) -> tuple[np.ndarray, np.ndarray]:
    """:func:`token_features` and :func:`answer_features` of one answer, reading the two texts once."""
    spans, flags = word_flags(context, response)
    return _token_features(spans, flags, offsets), _answer_features(flags)


def token_features(context: str, response: str, offsets) -> np.ndarray:
    """``[R, len(TOKEN_FEATURES)]``: per response token (character ``offsets`` into the response), the flags of the
    words it overlaps (their maximum; 0 for a token of white space or punctuation alone)."""
    return _token_features(*word_flags(context, response), offsets)


def _token_features(spans, flags: np.ndarray, offsets) -> np.ndarray:
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    out = np.zeros((len(offsets), len(TOKEN_FEATURES)), dtype=np.float32)
    if not spans or not len(offsets):
        return out
    starts = np.array([s for s, _ in spans])
    ends = np.array([e for _, e in spans])
    # words are disjoint and in order: a token overlaps the words first .. last (none when first > last)
    first = np.searchsorted(ends, offsets[:, 0], side="right")
    last = np.searchsorted(starts, offsets[:, 1], side="left") - 1
    hit = (first <= last) & (offsets[:, 1] > offsets[:, 0])
    out[hit] = flags[first[hit]]
    for i in np.flatnonzero(hit & (last > first)):  # a token over several words: the maximum of their flags
        out[i] = flags[first[i]:last[i] + 1].max(0)
    return out


def answer_features(context: str, response: str) -> np.ndarray:
    """:data:`ANSWER_FEATURES` of one answer: shares of unsupported content words, bigrams and trigrams, the
    (log) counts of unsupported numbers and names and the longest run of unsupported content words, and whether
    there is any unsupported number or name."""
    return _answer_features(word_flags(context, response)[1])


def _answer_features(flags: np.ndarray) -> np.ndarray:
    if not len(flags):
        return np.zeros(len(ANSWER_FEATURES), dtype=np.float32)
    content = flags[:, 5] > 0
    novel = flags[:, 0] > 0
    run = longest = 0
    for k in range(len(flags)):
        if novel[k]:
            run += 1
            longest = max(longest, run)
        elif content[k]:
            run = 0
    return np.array([novel.sum() / max(content.sum(), 1),
                     flags[1:, 1].mean() if len(flags) > 1 else 0.0,
                     flags[2:, 2].mean() if len(flags) > 2 else 0.0,
                     np.log1p(flags[:, 3].sum()), np.log1p(flags[:, 4].sum()), np.log1p(longest),
                     float(flags[:, 3].any()), float(flags[:, 4].any())], dtype=np.float32)
