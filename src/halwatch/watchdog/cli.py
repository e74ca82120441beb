"""``halwatch watch``: explore an agent's generalization bound, check queries, serve a local model over an
OpenAI-compatible HTTP API, and benchmark the monitor."""

from __future__ import annotations

import json

from halwatch.models.loader import add_device_options
from halwatch.progress import note
from halwatch.serve.common import add_server_options
from halwatch.watchdog.monitor import EPSILON

TARGET_HELP = "target agent's LLM: local:MODEL (default local:smollm2-135m) or http(s)://HOST:PORT/v1[#MODEL]"


def _client_options(p) -> None:
    p.add_argument("--target", default="local:smollm2-135m", help=TARGET_HELP)
    p.add_argument("--timeout", type=float, default=60.0, help="HTTP clients: seconds per request (default 60)")
    p.add_argument("--retries", type=int, default=3, help="HTTP clients: retries with backoff (default 3)")
    p.add_argument("--concurrency", type=int, default=4, help="HTTP clients: requests in flight (default 4)")


def add_parser(sub) -> None:
    p = sub.add_parser("watch", help="HalMit watchdog: explore an agent's generalization bound, check queries",
                       description="HalMit (Liu et al.): a black-box watchdog for a RAG agent over one SQuAD domain. "
                                   "`explore` finds queries the agent hallucinates on (fractal query generation, "
                                   "reinforced transform probabilities) and stores them as boundary points; `check` "
                                   "tells whether a new query is likely to produce a hallucination (Algorithm 1).")
    wsub = p.add_subparsers(dest="watch_cmd", required=True, metavar="ACTION")

    pe = wsub.add_parser("explore", help="explore a domain's generalization bound into a vector store (resumable)")
    pe.add_argument("--domain", required=True, help="SQuAD article title, e.g. Warsaw or 'Harvard University'")
    pe.add_argument("--store", required=True, help="sqlite:PATH (or PATH.db), postgresql://..., or pgserver:DIR")
    _client_options(pe)
    pe.add_argument("--generator", help="query-generation agents' LLM (default: the target's)")
    pe.add_argument("--judge", help="evaluation agent's judge LLM for queries without a reference (default: none, "
                                    "the faithfulness check against the retrieved context)")
    pe.add_argument("--policy", choices=["reinforced", "random"], default="reinforced",
                    help="transform probabilities: the policy network (default) or random (Figure 6's baseline)")
    pe.add_argument("--k", type=int, default=5, help="sampled answers per query for semantic entropy (default 5)")
    pe.add_argument("--paths", type=int, default=4, help="concurrent exploration paths (default 4)")
    pe.add_argument("--seeds", type=int, default=10, dest="n_seeds", help="seed questions (default 10)")
    pe.add_argument("--gamma", type=float, default=0.6, dest="gamma_stop",
                    help="stop when the hallucinated share reaches this (default 0.6)")
    pe.add_argument("--min-queries", type=int, default=20, help="explore at least this many queries (default 20)")
    pe.add_argument("--max-queries", type=int, default=100, help="explore at most this many queries (default 100)")
    pe.add_argument("--max-depth", type=int, default=6, help="steps before a path restarts from a seed (default 6)")
    pe.add_argument("--sample-temperature", type=float, default=0.5,
                    help="temperature of the k sampled answers (default 0.5)")
    pe.add_argument("--seed", type=int, default=0, help="random seed (default 0)")

    pc = wsub.add_parser("check", help="is a query likely to produce a hallucination? (JSON verdict)")
    pc.add_argument("query", help="the query to check")
    pc.add_argument("--store", required=True, help="an explored store")
    pc.add_argument("--domain", help="the domain (default: the store's)")
    pc.add_argument("--epsilon", type=float, default=EPSILON, help=f"similarity threshold (default {EPSILON})")
    pc.add_argument("--k", type=int, help="sampled answers for the query's entropy (default: the store's k)")
    _client_options(pc)

    pb = wsub.add_parser("bench", help="monitor vs predictive probability, ICL judge, SelfCheckGPT on held-out "
                                       "questions of the domain")
    pb.add_argument("--domain", required=True)
    pb.add_argument("--store", required=True, help="an explored store of that domain")
    pb.add_argument("--n-test", type=int, default=40, help="held-out questions (default 40)")
    pb.add_argument("--k", type=int, help="sampled answers per question (default: the store's k)")
    pb.add_argument("--epsilon", type=float, default=EPSILON)
    pb.add_argument("--judge", help="ICL judge's LLM (default: the target's)")
    pb.add_argument("--out", help="write the results (JSON) here")
    _client_options(pb)

    pf = wsub.add_parser("curve", help="entropy over the final exploration steps of stores (Figure 6)")
    pf.add_argument("--store", action="append", required=True, help="an explored store (repeat to compare)")
    pf.add_argument("--last", type=int, default=30, help="final steps to show (default 30)")
    pf.add_argument("--out", help="write the plot (PNG) here")

    ps = wsub.add_parser("serve-llm", help="serve a local model over the OpenAI chat-completions API",
                         description="A local model behind POST /v1/chat/completions (plain and streamed), "
                                     "GET /v1/models, /health/live, /health/ready and /metrics; OpenAPI page at "
                                     "/docs. SIGTERM drains the requests in flight, then stops.")
    ps.add_argument("--model", default="smollm2-135m", help="registry name or Hugging Face folder")
    add_server_options(ps, port=8000)
    add_device_options(ps)
    p.set_defaults(func=cmd_watch)


def _options(args) -> dict:
    return {"timeout": args.timeout, "retries": args.retries, "concurrency": args.concurrency}


def cmd_watch(args) -> int:
    from halwatch.watchdog import run

    if args.watch_cmd == "explore":
        from halwatch.progress import progress as progress_bar

        bar = progress_bar(total=args.max_queries, desc=f"explore {args.domain}", unit="query")

        def progress(explorer, event):
            probs = explorer.policy_probabilities()
            bar.n = len(explorer.events)
            bar.set_postfix(points=explorer.store.count(), gamma=f"{explorer.gamma:.2f}",
                            p="/".join(f"{x:.2f}" for x in probs) if probs else "-")

        config = {k: getattr(args, k) for k in ("policy", "k", "paths", "n_seeds", "gamma_stop", "min_queries",
                                                 "max_queries", "max_depth", "sample_temperature", "seed")}
        try:
            summary = run.explore(args.domain, args.store, args.target, args.generator, args.judge, progress,
                                  _options(args), **config)
        finally:
            bar.close()
        print(json.dumps(summary, indent=1))
    elif args.watch_cmd == "check":
        print(json.dumps(run.check(args.query, args.store, args.target, args.k, args.epsilon, args.domain,
                                   _options(args)), indent=1, ensure_ascii=False))
    elif args.watch_cmd == "bench":
        result = run.bench(args.domain, args.store, args.target, args.judge, args.n_test, args.k, args.epsilon,
                           out=args.out, client_options=_options(args), progress=not args.quiet)
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1, default=float))
    elif args.watch_cmd == "curve":
        print(json.dumps(run.curves(args.store, args.last, args.out), indent=1))
    elif args.watch_cmd == "serve-llm":
        from halwatch.serve.common import api_key_from, check_bind, serve
        from halwatch.serve.llm import build_app

        key = api_key_from(args.api_key_env)
        check_bind(args.host, key, args.insecure)
        app = build_app(args.model, api_key=key, queue_size=args.queue_size, timeout=args.timeout,
                        max_body_bytes=args.max_body_bytes, device=args.device, dtype=args.dtype)
        serve(app, args.host, args.port,
              on_started=lambda h, p: note(f"serving {args.model} at http://{h}:{p}/v1 (Ctrl-C or SIGTERM stops)"))
    return 0
