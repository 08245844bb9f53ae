"""What users run end to end, built on the pipeline: `compare` (solved against the baselines,
measured), `advise` (what to do when a step does not fit), `max_batch` and `bench`."""
