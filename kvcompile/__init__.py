"""kvcompile: the compile stage. Runs a model over calibration data and writes safetensors artifacts that the
runtime (`kvruntime`) loads."""

__version__ = "0.1.0"
