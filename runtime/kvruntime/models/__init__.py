"""Models: loading one (`model_loading`), what `--model` names, checked without loading it (`model_spec`), and the
shipped models, dequantised from their GGUF files into a checked cache (`default_model`)."""
