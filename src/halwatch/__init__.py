"""halwatch: detect hallucinations in retrieval-augmented LLM answers.

The public API:

- :class:`halwatch.Sample`: a prompt (or context + question) and a response, with optional label and gold spans.
- :class:`halwatch.Scorer`: runs a scoring language model once over ``prompt + response`` and returns the signals
  detectors ask for (cached on disk).
- :func:`halwatch.load_detector` / the classes in :mod:`halwatch.detectors`: the detector contract
  ``fit(samples, labels)``, ``score(samples)``, ``spans(sample)``, ``save(path)`` / ``load(path)``.
"""

from halwatch.errors import HalwatchError, InputError, ModelError
from halwatch.sample import Sample

__version__ = "0.1.0"

__all__ = ["HalwatchError", "InputError", "ModelError", "Sample", "Scorer", "load_detector", "__version__"]


def __getattr__(name):
    # Lazy imports keep `import halwatch` (and `halwatch --help`) fast: torch and transformers load only when needed.
    if name == "Scorer":
        from halwatch.scorer import Scorer

        return Scorer
    if name == "load_detector":
        from halwatch.detectors import load_detector

        return load_detector
    raise AttributeError(name)
