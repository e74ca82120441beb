"""HalMit (Liu et al.): a black-box watchdog for an LLM agent. It explores the agent's generalization bound with
fractal query generation (``explore``), keeps the boundary points in a vector store (``store``) and checks new
queries against them (``monitor``, Algorithm 1)."""

API = ("explore", "check", "bench", "curves")


def __getattr__(name):
    """``halwatch.watchdog.explore`` / ``check`` / ``bench`` / ``curves``: the functions of :mod:`.run`, imported on
    first use."""
    if name in API:
        from halwatch.watchdog import run

        return getattr(run, name)
    raise AttributeError(name)
