"""halwatch: detect hallucinations in retrieval-augmented LLM answers.

The face (:mod:`halwatch.checker`)::

    import halwatch

    hw = halwatch.load()
    result = hw.check(context="...", question="...", response="...")

- :func:`halwatch.load` -> :class:`halwatch.Checker`, whose ``check`` / ``check_many`` return
  :class:`halwatch.Result` s: the probability of hallucination, the verdict at the detector's threshold, the
  unsupported words as spans with their confidence, the task, how far the answer lies from the training data.
- :class:`halwatch.Sample`: a prompt (or context + question) and a response, with optional label and gold spans.
- For fitting and research: :class:`halwatch.Scorer` (the scoring model's one pass, its signals cached on disk) and
  :func:`halwatch.load_detector` / :func:`halwatch.detectors.create_detector` (the detectors' contract).
"""

from halwatch.errors import HalwatchError, InputError, ModelError
from halwatch.sample import Sample

__version__ = "0.1.0"

__all__ = ["Checker", "HalwatchError", "InputError", "ModelError", "Result", "Sample", "Scorer", "load",
           "load_detector", "__version__"]

_LAZY = {"Checker": "halwatch.checker", "load": "halwatch.checker", "Result": "halwatch.result",
         "Scorer": "halwatch.scorer", "load_detector": "halwatch.detectors"}


def __getattr__(name):
    # Lazy imports keep `import halwatch` (and `halwatch --help`) fast: torch and transformers load only when needed.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
