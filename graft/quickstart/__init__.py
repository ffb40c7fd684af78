"""`graft quickstart` (its flags: graft.commands.quickstart): `run` the command, `base` its cached warm-up model and
settings, `warmup` the supervised warm-up that builds that model."""

# The models `graft quickstart --model` takes: base.MODELS, named here without importing torch.
MODELS = ("tiny", "smollm2", "gemma3-270m")
