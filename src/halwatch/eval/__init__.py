"""Evaluation: speed benchmark (:mod:`.speed`)."""
