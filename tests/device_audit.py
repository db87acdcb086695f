"""Catch host/accelerator tensor mixes on a machine without an accelerator.

On a GPU, an operation that mixes a CUDA tensor with a CPU tensor of one or more dimensions fails
(a 0-dim CPU tensor is allowed as a scalar). On a CPU-only machine every tensor is on the CPU and
such a mix goes unnoticed. ``DeviceAudit`` replays the rule: while it is active, a tensor counts
as *on the device* if it was made with an explicit ``device=``, moved with ``.to(<device>)``,
marked (model weights), or computed from one that is; ``.cpu()`` brings it back to the host.
Any operation that takes both kinds (host ones of dimension >= 1) raises ``DeviceMix`` naming
the operation. It is stricter than CUDA in one way, on purpose: indexing a device tensor with a
host index tensor counts as a mix.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_MARK = "_audit_on_device"


class DeviceMix(AssertionError):
    pass


def mark(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        setattr(tensor, _MARK, True)


def on_device(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _MARK, False)


def _name(func) -> str:
    return getattr(func, "__name__", "")


def _moves_to_device(func, args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    if _name(func) == "to":
        return any(isinstance(a, (torch.device, str)) for a in args[1:])
    return False


class DeviceAudit(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        device = [t for t in tensors if on_device(t)]
        if device and _name(func) == "numpy":
            raise DeviceMix(f"numpy() of a device tensor {tuple(device[0].shape)}: move it with .cpu() first")
        if device and _name(func) != "cpu":
            host = [t for t in tensors if not on_device(t) and t.dim() > 0]
            if host:
                name = getattr(func, "__qualname__", None) or _name(func) or repr(func)
                raise DeviceMix(f"{name} mixes device tensors {[tuple(t.shape) for t in device]} with host "
                                f"tensors {[tuple(t.shape) for t in host]}")
        self.calls += 1
        out = func(*args, **kwargs)
        if _name(func) == "cpu":
            # A host tensor's .cpu() is the tensor itself; a device tensor's is a new host copy.
            return out.clone() if device and out is args[0] else out
        if not device and _moves_to_device(func, args, kwargs) and args and out is args[0]:
            out = out.clone()  # a host tensor's .to(cpu) is itself; on a GPU the move is a new tensor
        if device or _moves_to_device(func, args, kwargs):
            for leaf in tree_flatten(out)[0]:
                if isinstance(leaf, torch.Tensor):
                    mark(leaf)
        return out
