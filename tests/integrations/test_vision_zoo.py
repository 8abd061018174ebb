"""Vision and diffusion models people train, under distcompile's defaults, on 2 ranks.

timm's ViT with a linear drop-path schedule, timm's ConvNeXt (stochastic depth too),
torchvision's ResNet-18 (BatchNorm over 4 samples a rank) and diffusers' ``UNet2DModel``,
tiny configs with random weights (``tests/vision_zoo.py``), 3 SGD steps:

* ``aot_eager`` against eager DDP: the same kernels, the same random numbers, so losses
  and parameters agree to rtol 1e-4 / atol 1e-5;
* ``inductor`` against ``torch.compile(DDP)`` (Inductor's rounding differs from eager's,
  on BatchNorm over tiny batches by much more than elsewhere; both with
  ``fallback_random``): rtol 1e-3 / atol 1e-4;
* the ranks' parameters bitwise equal.

These need timm, torchvision and diffusers, and the registry's torchvision does not load
beside the CPU torch 2.13 wheel: CI runs this file in a virtualenv of its own with torch
2.14.1 and torchvision 0.29.1 (``.ci/vision-zoo``); elsewhere it skips with the reason.
The boolean-mask mixture of experts of the same issue needs none of them:
``tests/runtime/test_ddp_parity.py::test_experts_chosen_by_boolean_masks_train_as_eager_ddp``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.long

_MISSING = [m for m in ("timm", "torchvision", "diffusers") if importlib.util.find_spec(m) is None]
if not _MISSING:
    try:
        import torchvision  # noqa: F401 - a CUDA build beside a CPU torch fails right here
    except Exception as exc:  # noqa: BLE001
        _MISSING = [f"torchvision ({type(exc).__name__}: {str(exc)[:120]})"]

TOL = {"aot_eager": (1e-4, 1e-5), "inductor": (1e-3, 1e-4)}
ROWS = [
    ("vit_drop_path", "aot_eager"),
    ("vit_drop_path", "inductor"),
    ("convnext_atto", "aot_eager"),
    ("resnet18", "aot_eager"),
    ("resnet18", "inductor"),
    ("unet2d", "aot_eager"),
]


@pytest.mark.skipif(
    bool(_MISSING), reason=f"needs {', '.join(_MISSING)} (.ci/vision-zoo makes such an environment)"
)
@pytest.mark.parametrize(("model", "backend"), ROWS)
def test_vision_model_trains_as_its_reference(model: str, backend: str) -> None:
    from tests import vision_zoo

    results = run_ranks(vision_zoo.parity, 2, model, backend, timeout=900)
    rtol, atol = TOL[backend]
    for rank, res in enumerate(results):
        ref_losses, our_losses = res["losses"]
        np.testing.assert_allclose(
            our_losses, ref_losses, rtol=rtol, atol=atol, err_msg=f"losses, rank {rank}"
        )
        for n, p in res["ref_params"].items():
            np.testing.assert_allclose(res["params"][n], p, rtol=rtol, atol=atol, err_msg=f"{n}, rank {rank}")
        for n, b in res["ref_buffers"].items():
            np.testing.assert_allclose(
                res["buffers"][n], b, rtol=rtol, atol=atol, err_msg=f"{n}, rank {rank}"
            )
    for n, p in results[0]["params"].items():
        np.testing.assert_array_equal(results[1]["params"][n], p, err_msg=f"{n} differs between the ranks")
