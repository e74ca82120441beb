"""``halwatch serve``: detectors over HTTP (``/v1/score``, the guard proxy, the web page)."""

from __future__ import annotations

from halwatch.cli.options import (
    add_batch_size_option,
    add_device_options,
    add_min_span_confidence,
    add_windows_option,
)
from halwatch.progress import note


def add_parser(sub) -> None:
    """Serve detectors over HTTP: POST /v1/score (one item or a list), GET /v1/detectors, POST /v1/watch/check
    (HalMit), with --upstream a guard proxy at POST /v1/chat/completions, a web page at /, the OpenAPI page at
    /docs, /health/live, /health/ready and /metrics. Requests are batched into one forward pass. SIGTERM drains the
    requests in flight, then stops."""
    from halwatch.serve.common import STREAM_POLICIES, add_server_options

    p = sub.add_parser("serve", help="HTTP scoring service: /v1/score, a guard proxy in front of an LLM, a web page",
                       description=add_parser.__doc__)
    p.add_argument("--detector", nargs="+", help="shipped artifact names or artifact files to load; the first is "
                                                 "the default (default: the shipped 'default')")
    add_server_options(p, port=8080, timeout=120.0, queue_tokens=1 << 18, max_body_bytes=4 << 20)
    p.add_argument("--upstream", metavar="URL", help="an OpenAI-compatible LLM (http://HOST:PORT/v1) to guard: "
                                                     "POST /v1/chat/completions is forwarded and its answer scored")
    p.add_argument("--upstream-key-env", metavar="VAR", help="the upstream's API key, from this environment variable")
    p.add_argument("--stream-policy", choices=STREAM_POLICIES, default="annotate",
                   help="streamed answers through the guard (per request: halwatch_stream_policy): annotate (pass "
                        "through, verdict at the end; default), hold (release with the verdict), stop (score as it "
                        "streams, end with finish_reason content_filter when judged hallucinated)")
    p.add_argument("--stream-check-every", type=int, default=16, metavar="N",
                   help="stop policy: score the growing answer every N chunks (about a token each; default 16; per "
                        "request: halwatch_check_every)")
    add_min_span_confidence(p, "; per item: min_span_confidence")
    add_windows_option(p)
    p.add_argument("--max-items", type=int, default=64, help="items per /v1/score request (default 64)")
    add_batch_size_option(p, "answers per forward batch (default auto: 1 on a CPU, where batching gains nothing, 8 "
                             "on a GPU)")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="padded tokens per forward batch (answers x longest; default 8192)")
    p.add_argument("--batch-padding", type=float, default=0.1,
                   help="largest share of a batch's positions that may be padding: answers of similar length are "
                        "batched together (default 0.1; 1 batches any lengths)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long the batcher waits for more answers to join a batch (default 5 ms)")
    p.add_argument("--watch-store", metavar="STORE", help="an explored HalMit store for POST /v1/watch/check")
    p.add_argument("--watch-target", default="local:smollm2-135m", help="the watched agent's LLM (default "
                                                                        "local:smollm2-135m)")
    add_device_options(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from halwatch.detectors.spans import check_confidence
    from halwatch.serve.common import api_key_from, check_bind, serve
    from halwatch.serve.gate import configure_access_log
    from halwatch.serve.scoring import Limits, build_app

    key = api_key_from(args.api_key_env)
    check_bind(args.host, key, args.insecure)
    configure_access_log(args.access_log)
    limits = Limits(max_items=args.max_items, batch_size=args.batch_size, batch_tokens=args.batch_tokens,
                    batch_padding=args.batch_padding, batch_wait=args.batch_wait_ms / 1000,
                    queue_tokens=args.queue_tokens, timeout=args.timeout,
                    min_span_confidence=None if args.min_span_confidence is None
                    else check_confidence(args.min_span_confidence), windows=args.windows)
    watch = {"store": args.watch_store, "target": args.watch_target} if args.watch_store else None
    app = build_app(args.detector or ["default"], api_key=key, limits=limits, max_body_bytes=args.max_body_bytes,
                    upstream=args.upstream, upstream_key=api_key_from(args.upstream_key_env), watch=watch,
                    stream_policy=args.stream_policy, check_every=args.stream_check_every,
                    device=args.device, dtype=args.dtype)
    serve(app, args.host, args.port, drain_seconds=args.drain_timeout or args.timeout,
          on_started=lambda h, p: note(f"halwatch serve at http://{h}:{p} (page /, API /docs; Ctrl-C or SIGTERM "
                                       f"stops)"))
    return 0
