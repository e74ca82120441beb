"""Every causal-LM architecture of the installed transformers, as halwatch meets it: a tiny random-weight model of
each (built from its own config with small sizes, nothing downloaded), and what halwatch does with it.

Each architecture ends in one of three outcomes:

- ``works``: the capture's attention rows pass the check against the model's own eager attention
  (:func:`halwatch.models.forward.check_capture`), and an attention detector (Lookback Lens) fits and scores;
- ``refused``: halwatch refuses it in one line that names it (its attention does not run through transformers'
  attention interface, or the capture does not reproduce its eager attention, or the check cannot run);
- ``not built``: a small config of it cannot be made or run by transformers itself (its plain forward fails, it
  needs another library, or it stays large whatever the sizes): nothing halwatch could be asked to do.

``halwatch bench architectures`` prints the table; ``tests/test_architectures.py`` checks every architecture the same
way against eager maps computed in the test.
"""

from __future__ import annotations

import logging
import warnings

from halwatch.errors import ModelError, first_line

#: The sizes a tiny config is built with, tried in this order: every setting (one an architecture does not have is
#: ignored by it), then only the common ones, for architectures that derive the others (head sizes of latent
#: attention, rotary dimensions) or refuse to have them set.
CORE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048)
SMALL = (dict(CORE, head_dim=16, num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, shared_expert_intermediate_size=32),
         dict(CORE, num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              n_routed_experts=4, n_shared_experts=1), CORE)
#: An architecture whose tiny config still has more parameters than this is "not built" (a multimodal model's vision
#: tower, a byte-level model's hash embeddings).
MAX_PARAMETERS = 30_000_000


def causal_lm_types() -> list[str]:
    """The model types transformers can build as a causal LM, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build(model_type: str, tokenizer):
    """A tiny random-weight :class:`~halwatch.models.loader.ScoringModel` of ``model_type`` with ``tokenizer``
    (its vocabulary), seeded; or the reason it cannot be built (a string)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from halwatch.models.loader import ScoringModel

    def attempt(sizes: dict):
        defaults = AutoConfig.for_model(model_type).get_text_config()
        special = [getattr(defaults, f"{k}_token_id", None) for k in ("pad", "bos", "eos")]
        vocab = max([len(tokenizer)] + [i + 1 for i in special if isinstance(i, int)])  # ids the config names
        config = AutoConfig.for_model(model_type, **sizes, vocab_size=vocab)
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMETERS:
            return f"{size / 1e6:.0f} M parameters even with small sizes"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.inference_mode():
            model(input_ids=torch.arange(1, 9)[None], use_cache=False)  # transformers' own forward runs
        return ScoringModel(name=f"tiny-{model_type}", path="", weights_hash=f"random-{model_type}", model=model,
                            tokenizer=tokenizer)

    reason = ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet = logging.getLogger("transformers")
        level, quiet.level = quiet.level, logging.ERROR
        try:
            for sizes in SMALL:
                try:
                    return attempt(sizes)
                except Exception as exc:  # noqa: BLE001 - any failure to build or run it is the reason reported
                    reason = reason or first_line(exc)
        finally:
            quiet.setLevel(level)
    return reason


def outcome(model, train, held_out) -> tuple[str, str]:
    """``("works", "")`` when the capture passes its check and Lookback Lens fits on ``train`` and scores
    ``held_out``; ``("refused", the one-line refusal)`` otherwise. Any other exception propagates: it is a bug.

    Lookback Lens is fitted with ``C = 1`` (no cross-validated choice): the sweep asks whether an architecture's
    signals fit and score, not which regularisation a handful of answers prefers; the grid search was a third of the
    sweep's time."""
    from halwatch.detectors import create_detector
    from halwatch.scorer import Scorer

    scorer = Scorer(model=model, max_tokens=300, cache=None, batch_size=None, windows=1)
    try:
        detector = create_detector("lookback-lens", scorer=scorer, C=1.0)
        detector.fit(train)
        probs = detector.score(held_out)
    except ModelError as exc:
        return "refused", str(exc)
    if not ((probs > 0) & (probs < 1)).all():
        raise AssertionError(f"{model.name}: probabilities outside (0, 1): {probs}")
    return "works", ""


def answers(n_train: int = 6, n_held_out: int = 3) -> tuple[list, list]:
    """The shortest RAGTruth training answers (llama-2-7b-chat), half of them hallucinated: ``n_train`` to fit on,
    ``n_held_out`` more to score."""
    from halwatch.data.ragtruth import read_ragtruth

    short = sorted(read_ragtruth(split="train", generator="llama-2-7b-chat"),
                   key=lambda s: len(s.prompt) + len(s.response))
    train = [s for s in short if s.label][:n_train // 2] + [s for s in short if not s.label][:n_train - n_train // 2]
    return train, [s for s in short if s not in train][:n_held_out]


def survey(train=None, held_out=None, model_types=None, out=print) -> list[dict]:
    """:func:`build` and :func:`outcome` for every causal-LM type (or ``model_types``), printed as a table; the
    answers default to :func:`answers`."""
    if train is None:
        train, held_out = answers()
    from halwatch.models.loader import load_model
    from halwatch.progress import progress

    tokenizer = load_model("smollm2-135m").tokenizer
    rows = []
    types = model_types or causal_lm_types()
    with progress(total=len(types), desc="architectures", unit="model") as bar:
        for model_type in types:
            model = build(model_type, tokenizer)
            if isinstance(model, str):
                rows.append({"model_type": model_type, "outcome": "not built", "why": model})
            else:
                result, why = outcome(model, train, held_out)
                rows.append({"model_type": model_type, "class": type(model.model).__name__, "outcome": result,
                             "why": why.split(": ", 1)[-1].split(", so detectors")[0] if why else ""})
            bar.update(1)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("works", "refused", "not built")}
    out(f"{len(rows)} causal-LM architectures: {counts['works']} work, {counts['refused']} refused by name, "
        f"{counts['not built']} not built from a small config")
    out("| model type | class | outcome | why |")
    out("|---|---|---|---|")
    for r in rows:
        out(f"| `{r['model_type']}` | {r.get('class', '')} | {r['outcome']} | {r['why']} |")
    return rows
