"""The CUDA path: parity with eager DDP, and no host synchronization in a steady-state step.

Skipped without CUDA (CI has none). On a GPU machine: ``python -m pytest tests/gpu``.
Tolerances as in tests.runtime.test_parity.py (aot_eager 1e-4/1e-5, inductor 1e-3/1e-4).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile.models import GPT, GPTConfig, synthetic_batch
from tests.harness import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none found)")

TOL = {"aot_eager": (1e-4, 1e-5), "inductor": (1e-3, 1e-4)}


def _train(model: torch.nn.Module, cfg: GPTConfig, rank: int, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(cfg, batch_size=4, step=step, rank=rank, device=torch.device("cuda", 0))
        loss = GPT.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def _parity(rank: int, backend: str, **options: object) -> dict:
    cfg = GPTConfig(n_layer=2, n_embd=64)
    torch.manual_seed(0)
    base = GPT(cfg).cuda()
    ref = DDP(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=0.05)
    ours = distcompile.wrap(
        DDP(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=0.05), backend=backend, **options
    )
    ref_losses, our_losses = _train(ref, cfg, rank, 4), _train(ours, cfg, rank, 4)
    return {
        "losses": (ref_losses, our_losses),
        "params": [(a.detach().cpu(), b.detach().cpu()) for a, b in zip(ref.parameters(), ours.parameters())],
    }


def _check(res: dict, backend: str) -> None:
    rtol, atol = TOL[backend]
    torch.testing.assert_close(res["losses"][1], res["losses"][0], rtol=rtol, atol=atol)
    for a, b in res["params"]:
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)


@pytest.fixture
def nccl_world_of_one(tmp_path):  # noqa: ANN001, ANN201
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_parity_nccl_world_of_one(nccl_world_of_one, backend: str) -> None:
    _check(_parity(0, backend), backend)


def test_cudagraphs_parity(nccl_world_of_one) -> None:
    _check(_parity(0, "inductor", cudagraphs=True), "inductor")


def test_no_host_sync_in_a_steady_state_step(nccl_world_of_one) -> None:
    cfg = GPTConfig(n_layer=2, n_embd=64)
    torch.manual_seed(0)
    model = distcompile.wrap(DDP(GPT(cfg).cuda(), device_ids=[0], bucket_cap_mb=0.05), backend="inductor")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = [
        synthetic_batch(cfg, batch_size=4, step=s, rank=0, device=torch.device("cuda", 0)) for s in range(5)
    ]
    for x, y in batches[:3]:  # warm-up: compile, first flags
        GPT.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[3:]:
            GPT.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def _gloo_on_one_gpu(rank: int, world: int, backend: str) -> dict:
    torch.cuda.set_device(0)
    return _parity(rank, backend)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_parity_two_gloo_ranks_sharing_one_gpu(backend: str) -> None:
    for res in run_ranks(_gloo_on_one_gpu, 2, backend, timeout=900):
        _check(res, backend)
