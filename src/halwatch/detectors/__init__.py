"""Detectors on one contract (:class:`halwatch.detectors.base.Detector`), by name, and artifact loading."""

from __future__ import annotations

import json
from pathlib import Path

from halwatch.detectors.adapter import Adapter
from halwatch.detectors.attention import AttentionRatio, LLMCheckAttention, LookbackLens
from halwatch.detectors.base import ARTIFACT_FORMAT, Detector
from halwatch.detectors.baselines import LinearProbe, MaxEntropy, MeanEntropy, Perplexity, ResponseLength
from halwatch.detectors.fused import Fused
from halwatch.detectors.lrp4rag import LRP4RAG
from halwatch.detectors.polygraph import Polygraph
from halwatch.detectors.routed import Routed
from halwatch.detectors.sampling import EigenScore, LNEntropy, SelfCheckEntailment, SelfCheckNGram, SemanticEntropy
from halwatch.detectors.shipped import artifact_json, shipped_artifacts
from halwatch.detectors.toha import TOHA, TOHAMST, TOHACopyHeads
from halwatch.errors import HalwatchError, InputError

DETECTORS: dict[str, type[Detector]] = {
    cls.name: cls
    for cls in (Fused, Routed, TOHA, TOHACopyHeads, TOHAMST, LookbackLens, LRP4RAG, AttentionRatio, LLMCheckAttention,
                LinearProbe, Perplexity, MaxEntropy, MeanEntropy, ResponseLength, LNEntropy, EigenScore,
                SelfCheckNGram, SelfCheckEntailment, SemanticEntropy, Polygraph, Adapter)
}

#: Name of the shipped artifact that `halwatch score` uses when no detector is named.
DEFAULT_DETECTOR = "default"


def parse_setting(item: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> ``(key, value)``, the value read as JSON where it parses, else kept as text."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise InputError(f"a detector setting is KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def parse_settings(items) -> dict:
    """``["KEY=VALUE", ...]`` (a command line's ``--set``) -> ``{key: value}``."""
    return dict(parse_setting(item) for item in items or [])


def split_spec(spec: str) -> tuple[str, dict]:
    """A detector name, or ``name:key=value,key=value`` (the method with settings, e.g. ``lrp4rag:classifier=mlp``,
    so that a benchmark can compare variants of one method). A method with a ``positional_setting`` also takes one
    bare value for it: ``polygraph:Perplexity`` is ``polygraph:estimator=Perplexity``."""
    name, _, rest = spec.partition(":")
    settings, positional = {}, None
    for item in (item for item in rest.split(",") if item):
        if "=" in item:
            key, value = parse_setting(item)
            settings[key] = value
            continue
        if name not in DETECTORS:
            raise HalwatchError(f"unknown detector {name!r}: known methods are {', '.join(sorted(DETECTORS))}")
        key = getattr(DETECTORS[name], "positional_setting", None)
        if key is None:
            takers = sorted(n for n, c in DETECTORS.items() if getattr(c, "positional_setting", None))
            raise InputError(f"detector {name!r} takes its settings as KEY=VALUE, got {item!r} in {spec!r} (a bare "
                             f"value is taken only by {', '.join(takers)})")
        if positional is not None:
            raise InputError(f"detector spec {spec!r} has two bare values ({positional!r}, {item!r})")
        positional = item
    if positional is not None:
        key = DETECTORS[name].positional_setting
        if key in settings:
            raise InputError(f"detector spec {spec!r} sets {key!r} twice ({positional!r} and {key}=...)")
        settings[key] = parse_setting(f"{key}={positional}")[1]
    return name, settings


def create_detector(name: str, scorer=None, **kwargs) -> Detector:
    """A new, unfitted detector of the named method (or of a ``name:key=value,...`` spec, whose settings win over
    ``kwargs``)."""
    name, spec_settings = split_spec(name)
    kwargs = {**kwargs, **spec_settings}
    if name not in DETECTORS:
        raise HalwatchError(f"unknown detector {name!r}: known methods are {', '.join(sorted(DETECTORS))}")
    unknown = sorted(set(kwargs) - DETECTORS[name].setting_names())
    if unknown:
        raise HalwatchError(f"detector {name!r} has no setting(s) {unknown}: it takes "
                            f"{', '.join(sorted(DETECTORS[name].setting_names()))}")
    return DETECTORS[name](scorer=scorer, **kwargs)


def read_artifact(source: str | Path | dict) -> dict:
    """The JSON of an artifact file, of a shipped artifact by name, or an artifact's JSON already read, checked to
    be a halwatch artifact of a known detector."""
    if isinstance(source, dict):
        return _checked(source, "artifact")
    hint = (f"; {source!r} is a method: fit it first with `halwatch fit --detector {source}`"
            if source in DETECTORS else "")
    data, path = artifact_json(source, hint)
    return _checked(data, str(path))


def _checked(data, where: str) -> dict:
    if not isinstance(data, dict) or data.get("format") != ARTIFACT_FORMAT:
        raise HalwatchError(f"{where}: not a halwatch detector artifact (format {ARTIFACT_FORMAT} expected)")
    if data.get("detector") not in DETECTORS:
        raise HalwatchError(f"{where}: artifact of unknown detector {data.get('detector')!r}")
    return data


def load_detector(source: str | Path | dict = DEFAULT_DETECTOR, scorer=None, **scorer_options) -> Detector:
    """halwatch's one way to load a fitted detector: from a shipped artifact's name, an artifact file, or an
    artifact's JSON (:func:`read_artifact`), on ``scorer``; or, given ``scorer_options`` (those of
    :meth:`halwatch.scorer.Scorer.from_options`: ``model``, ``input_mode``, ``max_tokens``, ``cache``,
    ``batch_size``, ``device``, ``dtype``, ``windows``, ``remote``), on a new scorer of those options, each falling
    back to the artifact's scoring model, input mode and token cap. With neither, the scorer is made from the
    artifact's on first use. A scorer of another input mode or model is refused (:meth:`Detector.from_dict`)."""
    data = read_artifact(source)
    if scorer is None and scorer_options:
        from halwatch.scorer import Scorer

        scorer = Scorer.from_options(identity=data, **scorer_options)
    return DETECTORS[data["detector"]].from_dict(data, scorer=scorer)


__all__ = ["DETECTORS", "DEFAULT_DETECTOR", "Detector", "create_detector", "load_detector", "read_artifact",
           "parse_setting", "parse_settings", "shipped_artifacts", "split_spec"]
