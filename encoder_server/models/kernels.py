"""Faster kernels for a loaded tower's layers, the ones vLLM runs for the same weights: the patch embedding
as one matmul, and on CPU the linear layers as oneDNN matmuls on weights packed once at load."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class PatchwiseConv3d(nn.Conv3d):
    """A Conv3d whose kernel is its stride, run on inputs of exactly one kernel each (the Qwen patch
    embeddings: [patches, channels, t, p, p]) as one matmul over the flattened patches.

    The same weights and result within float rounding; vLLM's `Conv3dLayer` does the same. oneDNN's
    Conv3d took ~29 ms of a ~90 ms 448x448 forward on one CPU thread; timed side by side on its 1024
    patches, 24 ms against 8 ms for the matmul. On CUDA, torch >= 2.9 no longer sends Conv3d to cuDNN.
    """

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        if tuple(patches.shape[2:]) != self.kernel_size:
            return super().forward(patches)
        weight = self.weight.view(self.out_channels, -1)
        flat = F.linear(patches.reshape(patches.shape[0], -1), weight, self.bias)
        return flat.view(*flat.shape, 1, 1, 1)


class PackedLinear(nn.Linear):
    """An nn.Linear run by oneDNN on its weight reordered once into oneDNN's blocked layout.

    On this project's 2-core VM, one thread, float32: 2-5x faster than torch's MKL sgemm at a vision
    tower's shapes (432x128 @ 128x384: 0.47 -> 0.20 ms; 108x512 @ 512x2048: 7.7 -> 1.5 ms). vLLM's CPU
    build does the same for its tower (`dispatch_cpu_unquantized_gemm`: `onednn_mm` on a prepacked
    weight). The plain weight is released, as vLLM releases it: the packed copy is the weight now.
    """

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed_weight, self.bias, "none", [], ""
        )


def use_matmul_patch_embedding(patch_embed: nn.Module) -> None:
    """Turns a patch embedding's Conv3d (`patch_embed.proj`) into a PatchwiseConv3d, with its parameters."""
    conv = getattr(patch_embed, "proj", None)
    patchwise = (
        type(conv) is nn.Conv3d
        and conv.kernel_size == conv.stride
        and not any(conv.padding)
        and conv.dilation == (1, 1, 1)
        and conv.groups == 1
    )
    if patchwise:
        conv.__class__ = PatchwiseConv3d  # the same parameters, only the forward changes


def pack_linear_layers(module: nn.Module) -> int:
    """Packs every nn.Linear of a CPU module for oneDNN, where this torch build and CPU can run its dtype;
    returns how many were packed (0 when oneDNN cannot run them: they stay as they were)."""
    linears = [m for m in module.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"]
    if not linears or not _packed_linear_runs(linears[0].weight.dtype):
        return 0
    for linear in linears:
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        linear.__class__ = PackedLinear
        linear.packed_weight = packed
        linear.weight = nn.Parameter(torch.empty(0, dtype=linear.weight.dtype), requires_grad=False)
    return len(linears)


def _packed_linear_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs here for `dtype` and agrees with F.linear on a small case."""
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator).to(dtype)
    x = torch.randn(5, 32, generator=generator).to(dtype)
    try:
        got = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(weight, None), None, "none", [], ""
        )
    except (RuntimeError, AttributeError) as exc:  # a build without the op, or a dtype the CPU lacks
        log.info("oneDNN packed linear unavailable for %s (%s): the tower keeps torch's linear", dtype, exc)
        return False
    expected = F.linear(x, weight).float()
    return got.dtype == dtype and torch.allclose(got.float(), expected, rtol=1e-2, atol=1e-2)


def use_engine_kernels(tower: nn.Module) -> None:
    """The faster kernels for a Qwen-VL tower: its patch embedding as a matmul; its linears packed on CPU."""
    use_matmul_patch_embedding(tower.patch_embed)
    pack_linear_layers(tower)
