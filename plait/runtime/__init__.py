"""Running a parallel job, in three rooms and one door.

* :mod:`plait.runtime.parallelize`: the door (``plait.parallelize``): checks a config, picks
  the engine it runs on (:func:`plait.support.engine_of`) and builds the job.
* :mod:`plait.runtime.program`: the per-rank program and its passes (compiling a step into one
  FX graph over local tensors; gradient buckets, ZeRO, rematerialization, activation offload;
  the optimizer on local pieces). Imports no other room.
* :mod:`plait.runtime.engine`: the Job and what every job uses (the plan's executor, plain
  data parallel, placement, precision, checkpoints, evaluation and prediction, reports and
  metrics). Imports the program room.
* :mod:`plait.runtime.pipeline`: pipeline stages under torch's schedules (the stage job, each
  stage as a per-rank program, stage balancing and timing). Imports the other two.
"""
