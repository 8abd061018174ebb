"""Vision and diffusion models people train, for ``tests/integrations/test_vision_zoo.py``.

Tiny configs with random weights (no downloads). Each worker trains the same start on
each rank's own batches, first with the reference, then with distcompile under ``wrap``'s
defaults (the first-step forward check included), drawing the same random numbers in
both (drop path, dropout): ``torch.manual_seed`` before every step, and under Inductor
``fallback_random``, so that its random numbers are eager's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile

__all__ = ["MODELS", "parity"]

STEPS = 3


def _vit() -> nn.Module:
    import timm

    # DeiT's recipe in small: stochastic depth with a linear schedule (block 0 gets rate 0,
    # so it holds nn.Identity where the later blocks hold DropPath: Note [Regions only for
    # blocks alike]).
    return timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=4, depth=4, drop_path_rate=0.1, num_classes=10
    )


def _convnext() -> nn.Module:
    import timm

    return timm.create_model("convnext_atto", num_classes=10, drop_path_rate=0.1)


def _resnet() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)  # BatchNorm over 4 samples a rank


class _UNet(nn.Module):
    """diffusers' ``UNet2DModel`` predicting the noise: ``forward(x, t)`` returns the sample."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import UNet2DModel

        self.unet = UNet2DModel(
            sample_size=16,
            in_channels=3,
            out_channels=3,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=8,
        )

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.unet(x, t).sample


def _image_batch(rank: int, step: int, size: int = 32) -> tuple[tuple, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(4, 3, size, size, generator=g),), torch.randint(0, 10, (4,), generator=g)


def _unet_batch(rank: int, step: int) -> tuple[tuple, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, t = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 1000, (4,), generator=g)
    return (x, t), torch.randn(4, 3, 16, 16, generator=g)


#: name -> (builder, batch(rank, step) -> (inputs, target), loss(output, target))
MODELS = {
    "vit_drop_path": (_vit, _image_batch, F.cross_entropy),
    "convnext_atto": (_convnext, _image_batch, F.cross_entropy),
    "resnet18": (_resnet, _image_batch, F.cross_entropy),
    "unet2d": (_UNet, _unet_batch, F.mse_loss),
}


def parity(rank: int, world: int, name: str, backend: str) -> dict:
    """Train the reference and distcompile from one start; return losses and final parameters.

    ``backend="aot_eager"``: against eager DDP (the same kernels). ``"inductor"``: against
    ``torch.compile(DDP)``, whose Inductor rounding is distcompile's (both with Inductor's
    ``fallback_random``).
    """
    build, batch, loss_fn = MODELS[name]
    torch.manual_seed(0)
    base = build()
    ref: nn.Module = DDP(copy.deepcopy(base))
    if backend == "inductor":
        torch._inductor.config.fallback_random = True  # eager's random numbers in both
        ref = torch.compile(ref)
    ours = distcompile.wrap(DDP(copy.deepcopy(base)), backend=backend)
    losses = []
    for model in (ref, ours):
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        run = []
        for step in range(STEPS):
            inputs, target = batch(rank, step)
            torch.manual_seed(100 + step)  # the same drop-path masks for both models
            loss = loss_fn(model(*inputs), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(float(loss))
        losses.append(run)
    inner = ours.module
    return {
        "losses": losses,
        "ref_params": {n: p.detach().clone() for n, p in base_params(ref)},
        "params": {n: p.detach().clone() for n, p in inner.named_parameters()},
        "ref_buffers": {n: b.clone() for n, b in base_buffers(ref)},
        "buffers": {n: b.clone() for n, b in inner.named_buffers()},
        "graphs": len(ours.graphs),
    }


def _ddp(model: nn.Module) -> nn.Module:
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    return inner.module


def base_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The reference model's parameters, by name (through DDP and ``torch.compile``)."""
    return list(_ddp(model).named_parameters())


def base_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The reference model's buffers, by name."""
    return list(_ddp(model).named_buffers())
