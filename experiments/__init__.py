"""Experiment folders of the research repo (issue 10); shared helpers in ``experiments.common``."""
