"""Calibration study: corpus memory and distributed calibration (README.md)."""
