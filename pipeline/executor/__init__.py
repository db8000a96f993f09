"""Where a stage's per-prompt work runs: in the stage's own process (`executor.kind=serial`, the
default) or on Ray actors (`executor.kind=ray`, `pipeline.executor.cluster`).

A model stage comes in three parts. On the driver (the stage process): the plan and every
refusal, before any model loads. A `PromptWork`: a picklable object holding paths and configs
only (never weights: Ray re-sends an actor's constructor arguments when it restarts it, and an
evicted object breaks that, ray #53727); `setup()` loads the model, once per worker; `run(out,
prompt_id)` does one prompt, reading its inputs through `out.use` and writing its files through
`out.write_*`, and returns a small picklable value. Back on the driver: the set-level files from
those values, in the run's order.

`run_prompts` drives it. Serially, `out` is the `StageRun` itself: the work writes into the
stage's staging folder and every input is verified before it is read, as before. On Ray, `out` is
a `WorkerOutput`: the worker writes into a private temporary folder and returns the bytes with the
inputs it used; the stage verifies those inputs against their manifests (`StageRun.use`) and only
then writes the bytes into its staging folder. The stage process stays the only writer of
`artifacts/`, so DVC's outs, the manifests and the staging swap are as they are. The bytes are the
same either way: the work's code is the same and nothing in a file says where it ran; the
manifest's `executor` record says it (per prompt on Ray: node, device, kernel path).
"""
