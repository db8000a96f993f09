"""Config: the boundary where user input becomes typed, frozen objects.

`schema` parses each params.yaml section once (unknown keys, types, ranges, prompts, paths
that must stay inside the repository); `compose` turns conf/ + Hydra overrides into
params.yaml; `registry` says which params keys each stage reads. Nothing below this
package re-checks user input.
"""
