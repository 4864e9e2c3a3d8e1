"""Numeric precision of training, in Lightning's vocabulary: ``32-true``, ``tf32``, ``bf16-mixed``, ``16-mixed``.

* ``tf32``: float32 everywhere, but CUDA matmuls and convolutions may use TF32 tensor cores (10-bit
  mantissa inputs, float32 accumulation). No effect on CPU.
* ``bf16-mixed`` / ``16-mixed``: the wrapped model's forward runs under :func:`torch.autocast` (as
  Lightning Fabric and Accelerate do), its floating-point outputs are cast back to float32 so a loss
  computed outside the model is float32; weights, gradients and optimizer state stay float32.
* ``16-mixed`` adds a :class:`torch.amp.GradScaler`: the loss is scaled in ``context.backward``, the
  gradients unscaled before clipping, and a step whose gradients overflowed is skipped. The skip decision
  is all-reduced, so every training rank skips the same steps even when ranks hold different gradients
  (local SGD between averagings; parameter-server workers before they push). That check reads one flag
  back to the host each step: inherent to loss scaling, and why bf16 (no scaler) is preferred where
  the device has it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain import dist as ddist
from dtrain.errors import ConfigError


def check_precision(precision: str, device_type: str) -> None:
    """Refuse what the device cannot do (called by the launcher, before any worker starts)."""
    if precision == "16-mixed" and device_type != "cuda":
        raise ConfigError("precision '16-mixed' needs a CUDA GPU (float16 autocast with loss scaling); on CPU use "
                          "precision: bf16-mixed, or 32-true")


def _to_float32(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.float() if output.is_floating_point() and output.dtype != torch.float64 else output
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # namedtuple
        return type(output)(*(_to_float32(o) for o in output))
    if isinstance(output, (list, tuple)):
        return type(output)(_to_float32(o) for o in output)
    if isinstance(output, dict):
        return {k: _to_float32(v) for k, v in output.items()}
    return output


class Precision:
    """``32-true``: float32 everywhere, TF32 off on CUDA (even where a library turned it on). The base of the
    other precisions: no autocast, no loss scaling."""

    name = "32-true"
    dtype: torch.dtype | None = None  # autocast's dtype (None: no autocast)
    scaler: torch.amp.GradScaler | None = None
    allow_tf32 = False

    def __init__(self, device: torch.device) -> None:
        check_precision(self.name, device.type)
        self.device = device
        if device.type == "cuda":
            # Set both ways, so that "32-true" really is full float32 even where a library enabled TF32.
            torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
            torch.backends.cudnn.allow_tf32 = self.allow_tf32

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``with ctx.autocast():`` for code outside the wrapped model (a loss on the outputs, ...)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def wrap_forward(self, module: nn.Module) -> None:
        """Run ``module``'s forward under autocast and hand float32 outputs back (mixed precisions only).

        The forward is replaced on the instance (as Accelerate does), not wrapped in another module, so
        parameter names, ``state_dict`` and DDP/FSDP wrapping are exactly as without it.
        """
        if self.dtype is None or getattr(module, "_dtrain_autocast", False):
            return
        original: Callable[..., Any] = module.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with self.autocast():
                output = original(*args, **kwargs)
            return _to_float32(output)

        module.forward = forward  # type: ignore[method-assign]
        module._dtrain_autocast = True  # type: ignore[assignment]

    # Loss scaling: nothing to do but in 16-mixed.
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_and_check(self, optimizer: torch.optim.Optimizer, group: Any = None) -> bool:
        """Unscale ``optimizer``'s gradients; True when the step must be skipped (inf/NaN on any rank)."""
        return False

    def update(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class TF32(Precision):
    """``tf32``: float32, but CUDA matmuls and convolutions may use TF32 tensor cores."""

    name = "tf32"
    allow_tf32 = True


class BF16Mixed(Precision):
    """``bf16-mixed``: the wrapped forward under bfloat16 autocast; no loss scaling (bfloat16 has float32's
    range)."""

    name = "bf16-mixed"
    dtype = torch.bfloat16


class FP16Mixed(Precision):
    """``16-mixed``: float16 autocast with a GradScaler whose skip decision every rank shares."""

    name = "16-mixed"
    dtype = torch.float16

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.scaler = torch.amp.GradScaler(device.type)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_and_check(self, optimizer: torch.optim.Optimizer, group: Any = None) -> bool:
        self.scaler.unscale_(optimizer)
        # The flags unscale_ just computed, one per device (private but stable since torch 1.6). Reading
        # them avoids a second pass over every gradient.
        flags = list(self.scaler._found_inf_per_device(optimizer).values())
        if len(flags) == 1 and not ddist.is_distributed(group):
            # One device and nobody to agree with: the flag as it is, read as GradScaler.step reads it (the
            # one host sync of loss scaling), with no kernel of ours beside it.
            return bool(flags[0].item())
        found = torch.stack([f.to(self.device) for f in flags]).sum().clamp_(max=1.0)
        if ddist.is_distributed(group):
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        for flag in flags:  # update() must see the agreed flag, so every rank's scale moves alike
            flag.copy_(found)
        return bool(found.item())

    def update(self) -> None:
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scaler.load_state_dict(state)


_BY_NAME: dict[str, type[Precision]] = {cls.name: cls for cls in (Precision, TF32, BF16Mixed, FP16Mixed)}
PRECISIONS = tuple(_BY_NAME)


def make_precision(name: str, device: torch.device) -> Precision:
    """The precision called ``name`` on ``device``."""
    if name not in _BY_NAME:
        raise ConfigError(f"precision {name!r} is not one of {', '.join(PRECISIONS)}")
    return _BY_NAME[name](device)
