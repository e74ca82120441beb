"""Pure functions of one forward pass (no labels, no fitting): the per-head attention reducers that run inside the
pass (:mod:`halwatch.signals.reducers`, torch), their NumPy references (:mod:`halwatch.signals.lookback`,
:mod:`halwatch.signals.topology`) and the relevance statistics of LRP4RAG (:mod:`halwatch.signals.relevance`).
Nothing here imports the model layer."""
