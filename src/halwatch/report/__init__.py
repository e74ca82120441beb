"""``halwatch report``: a page people can look at for a file of scored answers (:mod:`halwatch.report.summary`
computes the figures, :mod:`halwatch.report.html` and :mod:`halwatch.report.markdown` lay them out)."""
