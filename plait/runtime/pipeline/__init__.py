"""Pipeline stages under torch's schedules: the stage job (:mod:`~plait.runtime.pipeline.job`),
each stage as a per-rank program (:mod:`~plait.runtime.pipeline.stage_program`), stage
balancing (:mod:`~plait.runtime.pipeline.stage_balance`) and the stages' timer
(:mod:`~plait.runtime.pipeline.stage_timer`). Imports the engine and program rooms."""
