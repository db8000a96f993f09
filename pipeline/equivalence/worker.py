"""One captured forward pass in a fresh process pinned to a kernel mode: the `kernels` variation.

`python -m pipeline.equivalence.worker JOB_JSON` pins `capture.kernels` before torch loads (the
pin has no effect afterwards: `pipeline.kernels`), then loads the snapshot, runs `run_capture`
on the job's ids, saves the tensors to the job's `out` and prints one JSON line: the threads
and kernel path it ran with. A refused pin (no AVX2 here) is one line on stderr, exit status 2.
"""

from __future__ import annotations

import json
import sys

from pipeline import kernels
from pipeline.errors import UserError


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    try:
        kernels.pin(job["kernels"])
    except UserError as e:
        print(e, file=sys.stderr)
        return 2
    import torch
    from safetensors.torch import save_file

    from pipeline.model import capture, loader
    from pipeline.store import provenance

    model = loader.load_model(job["snapshot"], loader.resolve_dtype(job["dtype"]), job["device"], job["attn"],
                              job["trust_remote_code"])
    spec = capture.CaptureSpec(attention_layers=tuple(job["attention_layers"]), positions=job["positions"])
    tensors = capture.run_capture(model, torch.tensor([job["ids"]]), spec)
    save_file({k: v.contiguous() for k, v in tensors.items()}, job["out"])
    print(json.dumps({"threads": torch.get_num_threads(), "kernel_path": provenance.kernel_path()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
