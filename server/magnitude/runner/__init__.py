"""The model runner: the only torch/transformers code (loading, paged attention, sampling, swap).

`from magnitude.runner import ModelRunner` is resolved lazily so that importing the package (for
`detokenize`, say) does not pull in torch.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("ModelRunner", "DraftProposer", "StepTiming"):
        from magnitude.runner import runner

        return getattr(runner, name)
    raise AttributeError(name)
