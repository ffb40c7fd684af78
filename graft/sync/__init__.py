"""Weight sync: get each new policy version from the trainer into every inference engine.

source    what a sync reads of the policy: the model itself, or an FSDP2 run's sharded source
publish   atomic, versioned, manifest-verified weight directories under RUN_DIR/weights
inflight  which policy versions running requests still use (never unload one of those)
adapter   adapter mode: load `<lora.name>-v<N>`, unload versions outside the retention window
merged    merged/full mode: write merged weights, reload them into the engines
verify    delivery verification: the engine serves exactly the trainer's policy (and the likely cause if not)
guard     what never reaches a server: non-finite adapters, or finite ones whose forward overflows
owner     adapter names, and the live run that uses a lora.name on a shared server (a flock on its
          publish root): an earlier run's adapters are unloaded, a live run's refused
served_adapter    `graft verify`'s delivery check for any server and adapter
"""
