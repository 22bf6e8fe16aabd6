"""Distilled study: the student's fit, its form, the layer allocation, coverage, and suite runs (README.md)."""
