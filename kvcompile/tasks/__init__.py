"""Prompt generators for calibration and evaluation, built locally (never downloaded)."""
