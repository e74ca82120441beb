"""Scoring language models: registry and pull (:mod:`.registry`), loading (:mod:`.loader`), forward pass
(:mod:`.forward`)."""

from halwatch.models.loader import ScoringModel, load_model
from halwatch.models.registry import DEFAULT_MODEL, MODELS, pull
from halwatch.models.signal_types import SignalRequest, Signals

__all__ = ["DEFAULT_MODEL", "MODELS", "ScoringModel", "SignalRequest", "Signals", "load_model", "pull"]
