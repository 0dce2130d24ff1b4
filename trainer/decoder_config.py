"""What every decoder the trainer builds is sized by, whichever executor runs it.

The reference GPT (trainer/reference/model.py) and the native executor's Llama-style model
(trainer/native/model.py) differ in their blocks, so each config adds its own sizes, but both read
tokens from the same vocabulary (trainer/data.py draws them) and hold their parameters in one
floating-point type. Those two fields, and the check that the type exists, live here once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int = 256
    dtype: str = "float32"  # float64 for the equivalence proofs

    def __post_init__(self) -> None:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"unknown dtype {self.dtype!r} for the model's parameters; "
                             "use a torch floating-point type such as float32, float64 or bfloat16")

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype
