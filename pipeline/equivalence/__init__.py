"""The equivalence matrix: the recorded forward pass re-run under each variation, compared with the record.

`variations` runs the passes, `matrix` is the stage's computation (its recording: `pipeline.record.equivalence`),
`worker` the subprocess of the `kernels` variation; the variation names are config literals
(`pipeline.config.schema.VARIATIONS`).
"""
