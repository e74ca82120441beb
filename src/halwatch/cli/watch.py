"""``halwatch watch``: explore an agent's generalization bound, check queries, serve a local model over an
OpenAI-compatible HTTP API, and benchmark the monitor."""

from __future__ import annotations

import json

from halwatch.cli.options import add_device_options
from halwatch.errors import HalwatchError
from halwatch.progress import note
from halwatch.serve.common import add_server_options
from halwatch.watchdog.monitor import EPSILON

TARGET_HELP = "target agent's LLM: local:MODEL (default local:smollm2-135m) or http(s)://HOST:PORT/v1[#MODEL]"


def _client_options(p) -> None:
    p.add_argument("--target", default="local:smollm2-135m", help=TARGET_HELP)
    p.add_argument("--agent", metavar="URL",
                   help="watch a black-box agent instead of the built-in RAG agent: an OpenAI-compatible endpoint "
                        "http(s)://HOST:PORT/v1[#MODEL] that is sent the query alone and does its own retrieval")
    p.add_argument("--timeout", type=float, default=60.0, help="HTTP clients: seconds per request (default 60)")
    p.add_argument("--retries", type=int, default=3, help="HTTP clients: retries with backoff (default 3)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="HTTP requests in flight per endpoint, and queries explored at once (default 4)")
    p.add_argument("--key-env", action="append", default=[], metavar="ENDPOINT=VAR",
                   help="send the API key in environment variable VAR to ENDPOINT (a URI as given to --agent, "
                        "--target, --generator or --judge, or its part before '#'); repeatable. Endpoints not named "
                        "get no key")
    p.add_argument("--answer-tokens", type=int, metavar="N",
                   help="cut the agent's answers at N tokens (explore: default 48 for the built-in agent, 128 for "
                        "--agent; check and bench: as the store was explored)")


def _domain_options(p, seeds: bool = True) -> None:
    p.add_argument("--domain", help="a SQuAD article title (e.g. Warsaw), or the title of --corpus")
    p.add_argument("--corpus", metavar="PATH",
                   help="your documents instead of a SQuAD article: a folder of .txt / .md / .jsonl files (one "
                        "object with \"text\" per line) or one such file")
    if seeds:
        p.add_argument("--seeds", metavar="FILE",
                       help="initial queries: JSONL with \"question\" and optional \"answers\" (reference answers), "
                            "or one question per line (default: the SQuAD article's questions; a corpus without "
                            "seeds starts from generated questions)")
    p.add_argument("--embedder", metavar="PATH",
                   help="sentence-transformers model folder for the query vectors (default all-MiniLM-L6-v2; a "
                        "store keeps the one it was explored with)")


def add_parser(sub) -> None:
    """HalMit (Liu et al.): a black-box watchdog for a RAG agent over one domain (a SQuAD article or your documents):
    the built-in agent, or yours behind an OpenAI-compatible endpoint (--agent). `explore` finds queries the agent
    hallucinates on (fractal fan-out query generation, reinforced transform probabilities) and stores them as
    boundary points; `check` tells whether a new query is likely to produce a hallucination (Algorithm 1)."""
    p = sub.add_parser("watch", help="HalMit watchdog: explore an agent's generalization bound, check queries",
                       description=add_parser.__doc__)
    wsub = p.add_subparsers(dest="watch_cmd", required=True, metavar="ACTION")

    pe = wsub.add_parser("explore", help="explore a domain's generalization bound into a vector store (resumable)")
    _domain_options(pe)
    pe.add_argument("--store", required=True, help="sqlite:PATH (or PATH.db), postgresql://..., or pgserver:DIR")
    _client_options(pe)
    pe.add_argument("--generator", help="query-generation agents' LLM (default: the target's)")
    pe.add_argument("--judge", help="judge LLM: labels answers to queries without a reference, and clusters answers "
                                    "by bidirectional entailment for semantic entropy (default: none: the "
                                    "faithfulness check against the context, and the cosine clustering fallback)")
    pe.add_argument("--policy", choices=["reinforced", "random"], default="reinforced",
                    help="transform probabilities: the policy network (default) or random (Figure 6's baseline)")
    pe.add_argument("--k", type=int, default=5, help="sampled answers per query for semantic entropy (default 5)")
    pe.add_argument("--fanout", type=int, default=3,
                    help="child queries drawn per expansion of a hallucinated query (default 3)")
    pe.add_argument("--n-seeds", type=int, default=10, help="seed questions (default 10)")
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
    _domain_options(pc, seeds=False)
    pc.add_argument("--epsilon", type=float,
                    help=f"similarity threshold (default: the store's calibrated one, else {EPSILON})")
    pc.add_argument("--k", type=int, help="sampled answers for the query's entropy (default: the store's k)")
    _client_options(pc)

    pb = wsub.add_parser("bench", help="monitor vs predictive probability, ICL judge, SelfCheckGPT on held-out "
                                       "questions of the domain")
    _domain_options(pb)
    pb.add_argument("--store", required=True, help="an explored store of that domain")
    pb.add_argument("--n-test", type=int, default=40, help="held-out questions (default 40)")
    pb.add_argument("--k", type=int, help="sampled answers per question (default: the store's k)")
    pb.add_argument("--epsilon", type=float,
                    help=f"similarity threshold (default: the store's calibrated one, else {EPSILON})")
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
    ps.add_argument("--mimic", action="append", default=[], metavar="QUIRK",
                    help="behave like other servers, to test clients against them (repeatable): ignore-n (one "
                         "choice whatever n asks, as Ollama and llama.cpp), refuse-logprobs (400), "
                         "max-completion-tokens (400 for max_tokens), content-parts (reply content as a list)")
    add_server_options(ps, port=8000)
    add_device_options(ps)
    p.set_defaults(func=cmd_watch)


def _options(args) -> dict:
    keys = {}
    for item in args.key_env:
        endpoint, sep, var = item.rpartition("=")
        if not sep or not endpoint or not var:
            raise HalwatchError(f"--key-env {item!r}: write ENDPOINT=VAR, e.g. http://gpu1:8000/v1=AGENT_KEY")
        keys[endpoint] = var
    return {"timeout": args.timeout, "retries": args.retries, "concurrency": args.concurrency, "keys": keys}


def _where(args) -> dict:
    if args.answer_tokens is not None and args.answer_tokens < 1:
        raise HalwatchError(f"--answer-tokens {args.answer_tokens}: give a positive number of tokens")
    return {"agent": args.agent, "corpus": args.corpus, "embedder": args.embedder, "answer_tokens": args.answer_tokens}


def cmd_watch(args) -> int:
    from halwatch.watchdog import run

    if args.watch_cmd == "explore":
        from halwatch.progress import progress as progress_bar

        bar = progress_bar(total=args.max_queries, desc=f"explore {args.domain or args.corpus}", unit="query")

        def progress(explorer, event):
            probs = explorer.policy_probabilities()
            bar.n = len(explorer.events)
            bar.set_postfix(points=explorer.store.count(), gamma=f"{explorer.gamma:.2f}",
                            p="/".join(f"{x:.2f}" for x in probs) if probs else "-")

        config = {k: getattr(args, k) for k in ("policy", "k", "fanout", "concurrency", "n_seeds", "gamma_stop",
                                                 "min_queries", "max_queries", "max_depth", "sample_temperature",
                                                 "seed")}
        try:
            summary = run.explore(args.domain, args.store, args.target, args.generator, args.judge, progress,
                                  _options(args), seeds=args.seeds, **_where(args), **config)
        finally:
            bar.close()
        print(json.dumps(summary, indent=1))
    elif args.watch_cmd == "check":
        print(json.dumps(run.check(args.query, args.store, args.target, args.k, args.epsilon, args.domain,
                                   _options(args), **_where(args)), indent=1, ensure_ascii=False))
    elif args.watch_cmd == "bench":
        result = run.bench(args.domain, args.store, args.target, args.judge, args.n_test, args.k, args.epsilon,
                           out=args.out, client_options=_options(args), progress=not args.quiet, seeds=args.seeds,
                           **_where(args))
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1, default=float))
    elif args.watch_cmd == "curve":
        print(json.dumps(run.curves(args.store, args.last, args.out), indent=1))
    elif args.watch_cmd == "serve-llm":
        from halwatch.serve.common import api_key_from, check_bind, serve
        from halwatch.serve.gate import configure_access_log
        from halwatch.serve.llm import build_app

        key = api_key_from(args.api_key_env)
        check_bind(args.host, key, args.insecure)
        configure_access_log(args.access_log)
        app = build_app(args.model, api_key=key, queue_tokens=args.queue_tokens, timeout=args.timeout,
                        max_body_bytes=args.max_body_bytes, device=args.device, dtype=args.dtype,
                        quirks=args.mimic)
        serve(app, args.host, args.port, drain_seconds=args.drain_timeout or args.timeout,
              on_started=lambda h, p: note(f"serving {args.model} at http://{h}:{p}/v1 (Ctrl-C or SIGTERM stops)"))
    return 0
