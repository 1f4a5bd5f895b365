"""Running a parallel job: applying layouts to a model, and the Job with its step."""
