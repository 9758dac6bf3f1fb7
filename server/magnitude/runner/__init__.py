"""The model runner: the only torch/transformers code (loading, paged attention, sampling, swap).

`from magnitude.runner import ModelRunner` is resolved lazily so that importing the package (for
`detokenize`, say) does not pull in torch.
"""

from __future__ import annotations

import os

# Before torch loads libgomp: idle OpenMP threads sleep instead of spinning. On a CPU host shared
# with other processes, spinning threads made a 2-thread step 20x slower than passive ones
# (8.9 s vs 0.42 s measured here for 8 decodes + a 64-token chunk). Override by setting it yourself.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def __getattr__(name: str):
    if name in ("ModelRunner", "DraftProposer", "StepTiming"):
        from magnitude.runner import runner

        return getattr(runner, name)
    raise AttributeError(name)
