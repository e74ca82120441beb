"""HalMit's third setting: an agent with a *known* hallucination boundary.

The built-in RAG agent is given a corpus that lacks a held-out part of the domain (the last paragraphs of a SQuAD
article), so questions about that part are its hallucination region by construction. The watchdog is seeded with
questions about the whole article, as a team would seed it from its users' questions.

    python known_boundary.py prepare DIR [--domain Warsaw] [--hold-out 16]
        writes DIR/corpus/DOMAIN.jsonl (the agent's documents: the article without its last HOLD_OUT paragraphs) and
        DIR/seeds.jsonl (every answerable question of the article with its answers and "region": known / missing)
    halwatch watch explore --domain Warsaw --corpus DIR/corpus --seeds DIR/seeds.jsonl --store STORE ...
    halwatch watch bench   --domain Warsaw --corpus DIR/corpus --seeds DIR/seeds.jsonl --store STORE --out BENCH
    python known_boundary.py analyse DIR STORE BENCH
        prints (JSON) where the explored queries and the boundary points fall (the article paragraph nearest to each
        query, by all-MiniLM-L6-v2) against the missing part's share of the article, the agent's hallucination
        rate per region, and every method's metrics with the region as the label
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from halwatch.watchdog.agent import Domain
from halwatch.watchdog.embed import embed
from halwatch.watchdog.run import _label_table
from halwatch.watchdog.store import open_store


def prepare(folder: Path, domain: str, hold_out: int) -> None:
    from halwatch.data.squad import read_squad

    article = Domain.squad(domain)
    missing = set(article.documents[-hold_out:])  # SQuAD paragraphs are distinct
    (folder / "corpus").mkdir(parents=True, exist_ok=True)
    kept = [p for p in article.documents if p not in missing]
    (folder / "corpus" / f"{article.title}.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in kept))
    questions = [q for q in read_squad() if q.title == domain.replace(" ", "_") and not q.is_impossible]
    rows = [{"id": q.id, "question": q.question, "answers": q.answers,
             "region": "missing" if q.context in missing else "known"} for q in questions]
    (folder / "seeds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gone = article.documents[-hold_out:]
    (folder / "paragraphs.json").write_text(json.dumps({"known": kept, "missing": gone}))
    print(json.dumps({"paragraphs": len(article.documents), "missing": len(missing), "questions": len(rows),
                      "questions_missing": sum(r["region"] == "missing" for r in rows)}))


def analyse(folder: Path, store: str, bench: str) -> dict:
    parts = json.loads((folder / "paragraphs.json").read_text())
    paragraphs = parts["known"] + parts["missing"]
    in_missing = np.array([False] * len(parts["known"]) + [True] * len(parts["missing"]))
    db = open_store(store)
    try:
        events = db.events()
    finally:
        db.close()
    missing_query = in_missing[np.argmax(embed([e["query"] for e in events]) @ embed(paragraphs).T, axis=1)]
    flagged = np.array([bool(e["hallucinated"]) for e in events])
    region = {row["id"]: row["region"] for row in map(json.loads, (folder / "seeds.jsonl").read_text().splitlines())}
    result = json.loads(Path(bench).read_text())
    rows = result["rows"]
    labels = [int(region[r["id"]] == "missing") for r in rows]
    per_region = {}
    for name in ("known", "missing"):
        mine = [r for r in rows if region[r["id"]] == name]
        counts = {f"hallucinated_{rule}": sum(r["labels"][rule] for r in mine) for rule in ("gqa", "contains")}
        per_region[name] = {"questions": len(mine), **counts}
    return {"explored_queries": len(events), "explored_in_missing_part": int(missing_query.sum()),
            "boundary_points": int(flagged.sum()),
            "boundary_points_in_missing_part": int((flagged & missing_query).sum()),
            "hallucinated_share_known": round(float(flagged[~missing_query].mean()), 4),
            "hallucinated_share_missing": round(float(flagged[missing_query].mean()), 4),
            "missing_share_of_paragraphs": round(float(in_missing.mean()), 4),
            "test_questions_by_region": per_region, "region_label": _label_table(labels, rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("folder", type=Path)
    p.add_argument("--domain", default="Warsaw")
    p.add_argument("--hold-out", type=int, default=16, help="last paragraphs left out of the agent's corpus")
    a = sub.add_parser("analyse")
    a.add_argument("folder", type=Path)
    a.add_argument("store")
    a.add_argument("bench")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.folder, args.domain, args.hold_out)
    else:
        print(json.dumps(analyse(args.folder, args.store, args.bench), indent=1))


if __name__ == "__main__":
    main()
