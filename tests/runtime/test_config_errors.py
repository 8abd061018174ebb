"""Bad input to wrap gives a clear, typed error that names the fix."""

from __future__ import annotations

import os
import pathlib
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile import Config, ConfigError, UnsupportedModelError


def test_not_a_module() -> None:
    with pytest.raises(UnsupportedModelError, match="expects a torch.nn.Module.*got function"):
        distcompile.wrap(lambda x: x)


def test_no_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="init_process_group"):
        distcompile.wrap(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"backend": "tvm"}, "backend='tvm' is not one of"),
        ({"compression": "int8"}, "compression='int8' is not supported"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb=0 must be a positive"),
        (
            {"bucket_cap_mb": "fast"},
            "bucket_cap_mb='fast' must be a positive number of MiB, None .* or 'auto'",
        ),
        ({"bucket_cap_mb": "auto", "first_bucket_cap_mb": 1}, "no effect with bucket_cap_mb='auto'"),
        ({"compression_scope": "head"}, "compression_scope='head' must be 'all' or 'tail'"),
        ({"compression_scope": "tail"}, "needs a compression format.*compression='bf16'"),
        ({"desync_timeout_s": -1}, "desync_timeout_s=-1"),
        ({"cudagraphs": True, "backend": "eager"}, "cudagraphs=True needs backend='inductor'"),
        ({"dynamic": "yes"}, r"dynamic='yes' \(str\) has the wrong type: dynamic takes True/False or None"),
        ({"bucket_cap_mb": True}, r"bucket_cap_mb=True \(bool\) has the wrong type"),
        ({"trace_every": 1.5}, "trace_every takes an integer"),
        ({"fullgraph": 1}, "fullgraph takes True/False"),
        ({"logdir": 3}, "logdir takes a string or a path or None"),
        ({"mode": "fast"}, "mode='fast' is not one of Inductor's presets"),
        ({"mode": "reduce-overhead"}, "pass cudagraphs=True instead"),
        ({"mode": "default", "backend": "aot_eager"}, "backend='aot_eager' does not use it"),
    ],
)
def test_bad_config(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Config(**options)


def test_numbers_and_paths_of_other_types_are_accepted() -> None:
    cfg = Config(logdir=pathlib.Path("runs/x"), bucket_cap_mb=np.float64(2.5), trace_every=np.int64(3))
    assert cfg.logdir == os.path.join("runs", "x") and cfg.bucket_cap_mb == 2.5 and cfg.trace_every == 3
    assert Config(mode="max-autotune-no-cudagraphs").mode == "max-autotune-no-cudagraphs"


def test_options_are_grouped_by_concern_and_read_by_name() -> None:
    import pickle

    cfg = Config(backend="aot_eager", bucket_cap_mb=4, verify=False, logdir=pathlib.Path("runs"))
    assert cfg.compile.backend == cfg.backend == "aot_eager"
    assert (
        cfg.communication.bucket_cap_mb == 4 and cfg.checks.verify is False and cfg.telemetry.logdir == "runs"
    )
    whole = Config(compile=distcompile.CompileOptions(backend="eager"), desync_timeout_s=5)
    assert (
        whole.backend == "eager"
        and whole.desync_timeout_s == 5
        and whole.communication == Config().communication
    )
    assert cfg.replace(backend="inductor").backend == "inductor" and cfg.backend == "aot_eager"
    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(cfg) == hash(Config(**{"backend": "aot_eager",
        "bucket_cap_mb": 4, "verify": False, "logdir": "runs"}))  # fmt: skip
    with pytest.raises(AttributeError, match="immutable"):
        cfg.backend = "eager"  # type: ignore[misc]
    with pytest.raises(AttributeError, match="did you mean 'backend'"):
        _ = cfg.backnd
    # An option given to the wrong group names the right one; a group of the wrong type is refused.
    with pytest.raises(
        ConfigError, match=r"'bucket_cap_mb' belongs to CommunicationOptions \(Config.communication\)"
    ):
        distcompile.CompileOptions(bucket_cap_mb=3)
    with pytest.raises(ConfigError, match="compile=.* must be a CompileOptions"):
        Config(compile=distcompile.CheckOptions())
    # Checks live in their group: the same errors whichever way the option came.
    with pytest.raises(ConfigError, match="backend='tvm' is not one of"):
        Config(compile=distcompile.CompileOptions(backend="tvm"))


def test_unknown_option(single_rank_group) -> None:
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['bucket_size'\]"):
        distcompile.wrap(nn.Linear(2, 2), bucket_size=3)


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"bucket_cap": 4}, "did you mean 'bucket_cap_mb'?"),
        ({"desync_timeout": 5}, "did you mean 'desync_timeout_s'?"),
        ({"find_unused_parameters": True}, "pass it to DDP(model, find_unused_parameters=...)"),
        ({"static_graph": True}, "pass it to DDP(model, static_graph=...)"),
        ({"options": {"max_autotune": True}}, "torch._inductor.config.patch"),
        ({"zzz": 1}, "'zzz' is not an option of distcompile"),
    ],
)
def test_a_misplaced_or_misspelt_option_names_where_it_goes(single_rank_group, options, names) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match=re.escape(names)):
        distcompile.wrap(nn.Linear(2, 2), **options)


def test_a_hook_and_compression_are_refused_together_however_they_meet(single_rank_group) -> None:
    def my_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations: none here
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    ddp = DDP(nn.Linear(2, 2))
    ddp.register_comm_hook(None, my_hook)
    with pytest.raises(
        ConfigError,
        match="compression=.bf16. and the DDP model.s communication hook .*my_hook.* Drop compression=",
    ):
        distcompile.wrap(ddp, compression="bf16", backend="eager")
    model = distcompile.wrap(DDP(nn.Linear(2, 2)), compression="bf16", backend="eager")
    with pytest.raises(ConfigError, match="both decide how gradients travel. Wrap without compression="):
        model.register_comm_hook(None, my_hook)


def test_cudagraphs_on_cpu(single_rank_group) -> None:
    with pytest.raises(ConfigError, match="cudagraphs=True needs a model on CUDA.*cpu"):
        distcompile.wrap(DDP(nn.Linear(2, 2)), cudagraphs=True)


def test_already_compiled(single_rank_group) -> None:
    with pytest.raises(UnsupportedModelError, match="already compiled"):
        distcompile.wrap(torch.compile(DDP(nn.Linear(2, 2))))
    wrapped = distcompile.wrap(DDP(nn.Linear(2, 2)), backend="eager")
    with pytest.raises(UnsupportedModelError, match="already compiled"):
        distcompile.wrap(wrapped)


@pytest.mark.parametrize("around", ["step", "module", "backward"])
def test_a_compile_around_the_wrapped_model_is_a_clear_error(single_rank_group, around: str) -> None:
    # A compiled step (forward and backward), or a compiled backward() alone, traced distcompile's
    # gradient hooks and failed as a CommunicationError naming the peers; torch.compile(wrapped)
    # as a TorchDynamo assertion.
    ours = distcompile.wrap(DDP(nn.Linear(2, 2)), backend="eager")

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = ours(x).sum()
        loss.backward()
        return loss

    runs = {
        "step": torch.compile(step),
        "module": lambda x: torch.compile(ours)(x).sum().backward(),
        "backward": lambda x: torch.compile(lambda loss: loss.backward())(ours(x).sum()),
    }
    run = runs[around]
    with pytest.raises(
        UnsupportedModelError, match="inside a torch.compile'd function.*torch.compile\\(loss_fn\\)"
    ):
        run(torch.randn(3, 2))
    step(torch.randn(3, 2))  # called outside any compile: it trains


def test_ddp_with_python_reducer_rejected(single_rank_group) -> None:
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        ddp = DDP(nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError, match="communicate twice"):
        distcompile.wrap(ddp)


def test_explain_auto_buckets_needs_wrap() -> None:
    with pytest.raises(ConfigError, match="measures the link on the process group"):
        distcompile.explain(nn.Linear(2, 2), torch.zeros(1, 2), bucket_cap_mb="auto")


@torch.library.custom_op("distcompile_test::no_autograd", mutates_args=())
def _no_autograd(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_no_autograd.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _NoAutogradOp(nn.Module):
    """TorchDynamo captures it fine; AOTAutograd fails on the op's missing backward formula."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_no_autograd(self.a(x)))


def test_failure_inside_torch_compile_names_graph_segment_version_and_ladder(single_rank_group) -> None:
    model = distcompile.wrap(_NoAutogradOp(), backend="aot_eager")
    with pytest.raises(distcompile.CompileError) as info:
        model(torch.randn(2, 4))
    text = str(info.value)
    assert "compiling piece 0 of 1 of graph 0" in text and f"torch {torch.__version__}" in text, text
    assert "no autograd formula" in text and "backend='eager'" in text, text
    assert isinstance(info.value.__cause__, RuntimeError)  # torch's own traceback stays chained


class _Holder(nn.Module):
    """A wrapper in the style of Lightning Fabric's: the DDP model is a registered child."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._forward_module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_module(x)


def test_data_parallel_inside_the_model_is_rejected(single_rank_group) -> None:
    net = nn.Linear(2, 2)
    with pytest.raises(
        UnsupportedModelError, match=r"contains a torch.nn.parallel.Distributed.* at '_forward_module'.*twice"
    ):
        distcompile.wrap(_Holder(DDP(net)))
    with pytest.raises(UnsupportedModelError, match=r"contains a torch.nn.parallel.Distributed.* at '0'"):
        distcompile.wrap(DDP(nn.Sequential(DDP(nn.Linear(2, 2)))))
    with pytest.raises(
        UnsupportedModelError, match=r"contains a distcompile.DistCompiledModule at '_forward_module'"
    ):
        distcompile.wrap(_Holder(distcompile.wrap(DDP(nn.Linear(2, 2)), backend="eager")))
    with pytest.raises(UnsupportedModelError, match=r"got a torch.nn.DataParallel"):
        distcompile.wrap(nn.DataParallel(nn.Linear(2, 2)))


def test_data_parallel_around_the_model_is_rejected_at_first_forward(single_rank_group) -> None:
    ours = distcompile.wrap(DDP(nn.Linear(2, 2)), backend="eager")
    outer = DDP(_Holder(ours))  # what Accelerate's prepare does to a wrapped model
    with pytest.raises(
        UnsupportedModelError, match=r"called from inside a torch.nn.parallel.Distributed.*twice"
    ):
        outer(torch.randn(3, 2)).sum().backward()
    alone = distcompile.wrap(DDP(nn.Linear(2, 2)), backend="eager")
    _Holder(alone)(torch.randn(3, 2)).sum().backward()  # a plain wrapper around it is fine


def test_unwrap_gives_the_users_model_back(single_rank_group) -> None:
    net = nn.Linear(2, 2)
    ours = distcompile.wrap(DDP(net), backend="eager")
    assert distcompile.unwrap(ours) is net
    assert distcompile.unwrap(torch.compile(DDP(net))) is net
    assert distcompile.unwrap(net) is net
    assert set(distcompile.unwrap(ours).state_dict()) == {"weight", "bias"}


def test_restartable_torchrun_workers_on_the_agents_store_are_warned_once(
    single_rank_group, monkeypatch, caplog
) -> None:  # noqa: ANN001
    """Issue 44: plain ``torchrun --max-restarts N`` shares the agent's store between attempts,
    and a restarted gloo group then fails to connect; wrap says what to set, once."""
    import logging

    import distcompile._wrap as wrap_module

    monkeypatch.setattr(wrap_module, "_warned_store", False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with caplog.at_level(logging.WARNING, logger="distcompile"):
        distcompile.wrap(DDP(nn.Linear(4, 4)), backend="eager")
        distcompile.wrap(DDP(nn.Linear(4, 4)), backend="eager")
    warnings = [
        r.getMessage() for r in caplog.records if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.getMessage()
    ]
    assert len(warnings) == 1, caplog.text
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.setattr(wrap_module, "_warned_store", False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distcompile"):
        distcompile.wrap(DDP(nn.Linear(4, 4)), backend="eager")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in caplog.text  # no restarts: nothing to say
