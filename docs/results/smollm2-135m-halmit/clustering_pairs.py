"""Semantic entropy's clustering on hand-made answer pairs: is each pair put in one cluster (same meaning) or two?
The cosine fallback (all-MiniLM-L6-v2 >= 0.85) against bidirectional entailment asked of a judge LLM, both through
``halwatch.watchdog.entropy``'s own clustering functions.

    python clustering_pairs.py [--judge local:smollm2-135m | http://HOST:PORT/v1#MODEL]

prints a Markdown table (one row per pair: the truth, the cosine, each rule's decision) and each rule's accuracy.
The pairs were written by hand before either rule was run: numbers and names that differ in one word (cosine's
failure: it merges them) and paraphrases of one fact in different words or lengths (cosine splits some).
"""

from __future__ import annotations

import argparse
import asyncio

from halwatch.watchdog.clients import open_client
from halwatch.watchdog.embed import embed
from halwatch.watchdog.entropy import THRESHOLD, embedding_clusters, entailment_clusters

# (question, answer A, answer B, same meaning?)
PAIRS = [
    ("What is the population of Warsaw?", "About 1.7 million people live in Warsaw.",
     "About 3.1 million people live in Warsaw.", False),
    ("What is the population of Warsaw?", "Warsaw has roughly 1.7 million inhabitants.",
     "The city's population is about 1.7 million.", True),
    ("On what river does Warsaw stand?", "The Vistula.", "Warsaw lies on the Vistula River.", True),
    ("On what river does Warsaw stand?", "The Vistula.", "The Oder.", False),
    ("When did the Warsaw Uprising begin?", "The uprising began in 1944.", "The uprising began in 1943.", False),
    ("When did the Warsaw Uprising begin?", "The uprising began in 1944.", "1944.", True),
    ("Who designed the Palace of Culture and Science?", "Lev Rudnev designed it.",
     "It was designed by the Soviet architect Lev Rudnev.", True),
    ("Who designed the Palace of Culture and Science?", "Lev Rudnev.", "Joseph Stalin.", False),
    ("What is the capital of Poland?", "Warsaw is the capital of Poland.", "Kraków is the capital of Poland.", False),
    ("What is the capital of Poland?", "Warsaw.", "The capital of Poland is Warsaw.", True),
    ("How many districts does Warsaw have?", "Warsaw is divided into 18 districts.", "It has eighteen districts.",
     True),
    ("How many districts does Warsaw have?", "Warsaw is divided into 18 districts.",
     "Warsaw is divided into 12 districts.", False),
]


async def run(judge_uri: str) -> None:
    judge = open_client(judge_uri)
    right = {"cosine": 0, "entailment": 0}
    print(f"| question | A | B | same meaning | cosine | cosine rule (>= {THRESHOLD}) | entailment ({judge_uri}) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    try:
        for question, a, b, same in PAIRS:
            va, vb = embed([a, b])
            by_cosine = len(set(embedding_clusters([a, b]))) == 1
            by_entailment = len(set(await entailment_clusters([a, b], question, judge))) == 1
            right["cosine"] += by_cosine == same
            right["entailment"] += by_entailment == same
            word = {True: "same", False: "different"}
            print(f"| {question} | {a} | {b} | {word[same]} | {float(va @ vb):.3f} | {word[by_cosine]} | "
                  f"{word[by_entailment]} |")
    finally:
        await judge.aclose()
    print(f"\nright: cosine {right['cosine']} / {len(PAIRS)}, entailment {right['entailment']} / {len(PAIRS)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--judge", default="local:smollm2-135m", help="the judge LLM (default local:smollm2-135m)")
    asyncio.run(run(parser.parse_args().judge))


if __name__ == "__main__":
    main()
