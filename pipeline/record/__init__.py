"""Record: the stage layer's recording, one module per stage that has a body.

Each module reads the stage's inputs through the run's ledger (`StageRun.use`: every input's sha256
checked against its producer's manifest), calls the library (`model/`, `numerics/`, `checks/`,
`equivalence/`) on values, and writes the results through the run (`write_parquet`, `write_json`,
`out`); a per-prompt `*Work` (`pipeline.executor.PromptWork`) runs each prompt here or on Ray
workers. Run by `stages/<name>.py` and, in one process, by `nexttoken verify`. Nothing below this
layer receives a `StageRun` or imports the executor (`tests/unit/test_layout.py`).
"""
