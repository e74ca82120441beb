"""``halwatch bench relevance``: the LRP4RAG relevance pass against one forward + backward pass on a real RAGTruth
QA prompt and answer, and how well each propagation method conserves relevance."""

from __future__ import annotations

from halwatch.eval.speed import median_seconds, speed_samples


def relevance_view(scorer, prompt_tokens: int, response_tokens: int):
    """The token view of a real RAGTruth QA prompt cut to ``prompt_tokens`` and a real answer cut to
    ``response_tokens`` tokens."""
    from halwatch.data.ragtruth import read_ragtruth
    from halwatch.sample import Sample

    base = speed_samples([prompt_tokens])[prompt_tokens]
    longest = max(read_ragtruth(split="test", generator="llama-2-7b-chat"), key=lambda s: len(s.response))
    tokenizer = scorer.model.tokenizer
    response = tokenizer.decode(tokenizer(longest.response, add_special_tokens=False)["input_ids"][:response_tokens])
    return scorer.encode(Sample(id="relevance-speed", prompt=base.prompt, response=response,
                                context_span=base.context_span))


def run_relevance_speed(model: str = "smollm2-135m", prompt_tokens: int = 512, response_tokens: int = 128,
                        repeats: int = 3, out=print) -> dict:
    """``halwatch bench relevance``: the LRP4RAG relevance pass against one forward + backward pass, and the
    conservation of relevance by each method."""
    import logging

    import torch

    from halwatch.models import forward
    from halwatch.models import relevance as lrp
    from halwatch.models.relevance import RelevanceRequest
    from halwatch.models.signal_types import SignalRequest
    from halwatch.scorer import Scorer

    logging.getLogger("halwatch").setLevel(logging.ERROR)
    scorer = Scorer(model=model, max_tokens=prompt_tokens + response_tokens, cache=None)
    sm = scorer.model
    view = relevance_view(scorer, prompt_tokens, response_tokens)
    forward.install(sm.model)
    ids = torch.tensor([view.input_ids])

    def forward_backward():
        with torch.enable_grad():
            embeds = sm.model.get_input_embeddings()(ids).detach().requires_grad_()
            logits = sm.model(inputs_embeds=embeds, logits_to_keep=view.n_response + 1).logits
            values, _ = lrp.targets(logits, [view], len(view.input_ids) - view.n_response - 1, "token")
            torch.autograd.grad(values.sum(), embeds)

    def relevance(method, rows, batched=None):
        request = SignalRequest(relevance=RelevanceRequest(method=method, rows=rows))
        lrp.BATCHED = batched
        try:
            return forward.run(sm, [view], request)[0]
        finally:
            lrp.BATCHED = None

    results = {"model": sm.name, "threads": torch.get_num_threads(), "device": str(sm.model.device),
               "tokens": len(view.input_ids), "prompt_tokens": view.n_prompt, "response_tokens": view.n_response}
    base = median_seconds(forward_backward, repeats)
    results["forward_backward_s"] = base
    out(f"model {sm.name} on {results['device']} ({results['threads']} threads): prompt {view.n_prompt} tokens, "
        f"response {view.n_response} tokens; one forward + backward pass {base:.2f} s")
    out(f"{'what':<58} {'seconds':>8} {'x fwd+bwd':>10}")
    timings = [
        ("lrp: R^prompt + R^response (eq. 5-6), 1 backward + 1 JVP", "lrp", 0, None, repeats),
        ("ixg: R^prompt + R^response", "ixg", 0, None, repeats),
        ("lrp: + R* resampled to 16 response rows (LSTM input)", "lrp", 16, None, 1),
        (f"lrp: whole R* ({view.n_response} rows), one backward per row", "lrp", -1, False, 1),
        (f"lrp: whole R*, vmapped batches of {lrp.SEED_CHUNK} rows", "lrp", -1, True, 1),
    ]
    for label, method, rows, batched, n in timings:
        seconds = median_seconds(lambda: relevance(method, rows, batched), n, warm_up=n > 1)
        results[label] = seconds
        out(f"{label:<58} {seconds:>7.2f}s {seconds / base:>9.1f}x")
    out("conservation: sum of input relevance (all input tokens) against the explained logit, mean over the "
        "response tokens")
    for method in ("lrp-cp", "lrp", "ixg"):
        r = relevance(method, 0).relevance
        total, logit = float(r["mean"].sum()), float(r["logits"].mean())
        results[f"conservation_{method}"] = (total - logit) / logit
        out(f"  {method:<7} relevance {total:8.3f}  logit {logit:8.3f}  relative error {(total - logit) / logit:+.2e}")
    return results
