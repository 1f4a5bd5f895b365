"""The Job and what every job uses: the step (:mod:`~plait.runtime.engine.job`), the plan's
executor and re-planning (:mod:`~plait.runtime.engine.plan_exec`,
:mod:`~plait.runtime.engine.replan`), plain data parallel
(:mod:`~plait.runtime.engine.data_parallel`), placement and meta initialisation, precision,
checkpoints, evaluation and prediction, pretrained weights, host modules, reports, memory
measurement and metrics. Imports the program room, never the pipeline room."""
