"""Artifacts: the file format (`artifact`), headers read without torch (`artifact_header`), every kind's schema and
reader (`artifact_kinds`), bundles (`bundle`), safe files (`files`), the model fingerprint (`fingerprint`) and the
tuned defaults an artifact recommends (`tuned_defaults`). Torch-free until `artifact` is imported."""
