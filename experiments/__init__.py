"""Experiment folders of the research repo; shared helpers in ``experiments.common``."""
