"""The platform under the trainer (graft.train) and the tenant service (graft.tenants): the process
group and its collectives, parallelize (TP, activation checkpointing, compile, FSDP2), the activation
memory auto checkpointing spends, and cutting passes short when a run stops. It knows no batch type
and no loss: both users call it in the same order on every rank."""
