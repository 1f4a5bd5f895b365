"""The per-rank program and its passes: a step compiled into one FX graph over local tensors
with every collective explicit (:mod:`~plait.runtime.program.compile`), gradient buckets
(:mod:`~plait.runtime.program.grad_sync`), optimizer parallel
(:mod:`~plait.runtime.program.zero`), rematerialization
(:mod:`~plait.runtime.program.remat`), activation offload
(:mod:`~plait.runtime.program.offload`) and the optimizer on local pieces
(:mod:`~plait.runtime.program.local_optim`). Imports no other room of the runtime."""
