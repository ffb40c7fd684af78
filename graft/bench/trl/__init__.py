"""TRL's side of the side-by-side benches, kept apart from graft's dependencies.

env            the TRL virtualenv (built once under the cache) and `run_trl`, which runs a worker there
worker         `graft bench e2e` / `graft bench learning`: GRPOTrainer + PEFT on graft's task and rewards
memory_worker  `graft bench memory`: one GRPOTrainer + PEFT optimizer step on graft's fixed batch
update_worker  `graft bench update`: the same on this machine's device, timed per step

The workers run as `python -m graft.bench.trl.<worker> SPEC.json OUT.json` in the TRL virtualenv,
which has graft's source on its path but not graft's dependencies: this package imports nothing.
"""
