"""`graft quickstart`: `command` its flags, `run` the command, `base` its cached warm-up model and
settings, `warmup` the supervised warm-up that builds that model."""
