"""Test-only: a Python whose environment holds the GPU check's list and nothing of the pipeline's extras.

Any process started with this folder on PYTHONPATH cannot import Hydra, omegaconf, DVC,
pydantic, psutil or accelerate at all (as if not installed), and the repository's own code
(pipeline/, bench/) cannot import PyYAML (transformers' own imports may: huggingface_hub
needs it, so it is there wherever transformers is). See tests/integration/test_gpu_check.py.
"""

import os
import sys

HIDDEN = ("hydra", "omegaconf", "dvc", "pydantic", "psutil", "accelerate")
NOT_FOR_OUR_CODE = ("yaml",)
_OURS = tuple(os.path.join(os.environ["NEXTTOKEN_BARE_REPO"], d) + os.sep for d in ("pipeline", "bench"))


class _NotForOurCode:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in NOT_FOR_OUR_CODE:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(_OURS):
                raise ImportError(f"bare site: {frame.f_code.co_filename} imports {name}")
        return None


for _name in HIDDEN:
    sys.modules[_name] = None        # `import hydra` -> ModuleNotFoundError; find_spec -> None
sys.meta_path.insert(0, _NotForOurCode())
print(f"bare site: hiding {', '.join(HIDDEN)}; {', '.join(NOT_FOR_OUR_CODE)} for pipeline/ and bench/",
      file=sys.stderr)
