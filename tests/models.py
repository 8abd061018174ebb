"""Small models that exercise distinct cases of the engine."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from distcompile.models import GPT, GPTConfig


def mlp_seq() -> nn.Module:
    """nn.Sequential (DDP's own forward compiles nothing here: pytorch#140416)."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)], nn.Linear(64, 8))


class ConvBN(nn.Module):
    """Convolutions with BatchNorm buffers (broadcast_buffers matters)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
        )
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=(2, 3)))


class GraphBreak(nn.Module):
    """Two captured graphs with eager code between them, and a weight used in both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        self.b = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        self.shared = nn.Linear(64, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.a(x))
        print_in_forward = h.sum().item()  # noqa: F841 - a data-dependent graph break
        torch._dynamo.graph_break()
        h = self.b(h) + self.shared(h)
        return self.out(h)


class Unused(nn.Module):
    """A branch whose parameters never get a gradient (find_unused_parameters=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        self.unused = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=64))


def gpt_bf16() -> nn.Module:
    """``gpt`` with its parameters in bfloat16 (trained in bfloat16 throughout)."""
    return gpt().to(torch.bfloat16)


def one_piece() -> nn.Module:
    """Small enough for one bucket, no repeated blocks: a graph compiled as one piece."""
    return nn.Sequential(nn.Linear(64, 16), nn.GELU(), nn.Linear(16, 8))


BUILDERS = {
    "mlp_seq": mlp_seq,
    "one_piece": one_piece,
    "convbn": ConvBN,
    "graph_break": GraphBreak,
    "unused": Unused,
    "gpt": gpt,
    "gpt_bf16": gpt_bf16,
}


def batch(name: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets that differ per rank and step (so averaging matters)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name in ("gpt", "gpt_bf16"):
        idx = torch.randint(0, 128, (4, 16), generator=g)
        return idx, torch.roll(idx, -1, dims=1)
    if name in ("convbn", "qat_eager", "qat_fx"):
        return torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 8, generator=g)
    if name == "autocast_inside":  # three classes
        return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    if name == "mask_moe_unrolled":  # token types 0 to r + 1 on rank r
        x = torch.randn(8, 64, generator=g)
        x[:, 0] = torch.randint(0, min(rank + 2, 4), (8,), generator=g)
        return x, torch.randn(8, 8, generator=g)
    if name.startswith("mask_moe"):  # token types 2r and 2r + 1 on rank r (mod 4)
        x = torch.randn(8, 64, generator=g)
        x[:, 0] = (2 * rank + torch.randint(0, 2, (8,), generator=g)) % 4
        return x, torch.randn(8, 8, generator=g)
    return torch.randn(8, 64, generator=g), torch.randn(8, 8, generator=g)


def step_each(models: tuple, opts: list, loss_of: object) -> list[float]:
    """One optimizer step of each model on ``loss_of(model)``; each model's loss, in order."""
    losses = []
    for model, opt in zip(models, opts):
        loss = loss_of(model)  # type: ignore[operator]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def loss_fn(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name in ("gpt", "gpt_bf16"):
        return GPT.loss(out, target)
    if name == "autocast_inside":
        return F.cross_entropy(out, target)
    return F.mse_loss(out, target)


# --- Models that use torch.compile's fine-grained tracing APIs and other odd but legal code ---


class _EagerOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class CompilerDisable(nn.Module):
    """A submodule that TorchDynamo must skip (its parameters are only read by eager code)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(64, 64)
        self.eager = _EagerOnly()
        self.post = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.eager(torch.relu(self.pre(x))))


def _helper_scale(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) * 2.0


def _inner_traced(x: torch.Tensor) -> torch.Tensor:
    return torch.cos(x)


@torch.compiler.disable(recursive=False)
def _outer_skipped(x: torch.Tensor) -> torch.Tensor:
    return _inner_traced(x) + 1.0


class _TwoLayer(nn.Module):
    """Linear(64, 64) -> mid(h) -> Linear(64, 8); subclasses define ``mid``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 8)

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.mid(self.a(x)))


class DisableNonRecursive(_TwoLayer):
    """torch.compiler.disable(recursive=False): the function runs eagerly, its callees compile."""

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return _outer_skipped(h)


_allowed = torch.compiler.allow_in_graph(_helper_scale)


class AllowInGraph(_TwoLayer):
    """A function kept opaque in the graph (torch.compiler.allow_in_graph)."""

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return _allowed(h)


class DisallowInGraph(_TwoLayer):
    """A torch function excluded from graphs (torch._dynamo.disallow_in_graph) forces a break."""

    def __init__(self) -> None:
        super().__init__()
        torch._dynamo.disallow_in_graph(torch.special.expit)  # process-wide; only this model uses expit

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return torch.special.expit(h)


class IsCompiling(_TwoLayer):
    """Branches on torch.compiler.is_compiling() (both branches compute the same values)."""

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(h) if torch.compiler.is_compiling() else torch.clamp(h, min=0)


@torch.library.custom_op("distcompile_tests::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_tanh_backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
    (x,) = ctx.saved_tensors
    return grad * ctx.scale * (1 - torch.tanh(x) ** 2), None


def _scaled_tanh_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)


class CustomOp(_TwoLayer):
    """A torch.library.custom_op (opaque to the compiler, with its own autograd formula)."""

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return scaled_tanh(h, 1.5)


class FuncTransforms(nn.Module):
    """torch.func inside forward: vmap over a functional_call, and a gradient penalty via grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = dict(self.a.named_parameters())

        def one(sample: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.a, params, (sample,))

        h = torch.tanh(torch.func.vmap(one)(x))
        # d/dh of a smooth function of h, per sample: stays differentiable w.r.t. parameters.
        g = torch.func.vmap(torch.func.grad(lambda v: (v**3).sum()))(h)
        return self.head(h + 0.1 * g)


class JacRev(nn.Module):
    """torch.func.jacrev inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(64, 8)
        self.pre = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.pre(x))  # (batch, 8)
        jac = torch.func.vmap(torch.func.jacrev(lambda v: torch.tanh(self.a(v))))(z)  # (batch, 8, 8)
        return self.b(jac.flatten(1))


class NumpyInForward(_TwoLayer):
    """NumPy code inside forward (TorchDynamo traces it through torch._numpy)."""

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        import numpy as np

        scale = np.sqrt(h.shape[-1])  # a NumPy scalar
        mask = torch.from_numpy(np.greater(h.detach().numpy(), 0.0).astype(np.float32))
        return h * mask / float(scale)


class Checkpointed(nn.Module):
    """Activation checkpointing (non-reentrant) inside a segment."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(3)
        )
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
        return self.head(x)


class OddStrides(nn.Module):
    """Transposed, non-dense, channels-last and expanded tensors cross segment boundaries.

    Every layer holds more than the tests' 0.05 MiB bucket cap, so each is its own segment,
    and each layer reads its input exactly as the previous segment left it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(8, 2048)
        self.c = nn.Linear(1024, 64)
        self.d = nn.Linear(16, 1024)
        self.head = nn.Linear(1024, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.a(x).t()  # (256, 8), transposed: dense, not contiguous
        half = self.b(t)[:, ::2]  # a strided view: not dense
        img = self.c(half).view(256, 16, 2, 2).contiguous(memory_format=torch.channels_last)
        pooled = self.d(img.permute(0, 2, 3, 1)).mean((1, 2))  # (256, 1024)
        wide = pooled.mean(0, keepdim=True).expand(256, 1024)  # stride 0
        return (self.head(wide) + pooled[:, :16]).view(8, 8, 64).mean(-1)


class _Res(nn.Module):
    def __init__(self, d: int, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:  # inside the block, as Hugging Face's gradient checkpointing does
            return x + torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False)
        return x + self._body(x)


class _Mix(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * 0.5 + x


class Repeats(nn.Module):
    """Identical blocks (compiled once, reused) around a different one, then checkpointed ones.

    ``layers`` is A, B, A, A: A's compiled pieces are last used after B's, so their lazily
    compiled backwards must find their own metadata (Note [Repeated blocks]). Each A holds
    1.3x the tests' 0.05 MiB bucket cap: a bucket and a piece of its own, not cut inside.
    ``tail`` blocks have another width and checkpoint their body.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)  # so that every A block's input requires grad
        self.layers = nn.ModuleList([_Res(64), _Mix(64), _Res(64), _Res(64)])
        self.proj = nn.Linear(64, 32)
        self.tail = nn.ModuleList([_Res(32, checkpointed=True) for _ in range(3)])
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        x = self.proj(x)
        for layer in self.tail:
            x = layer(x)
        return self.out(x)


class _Square(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(d, d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.b(torch.tanh(self.a(x))))


class CheckpointAround(nn.Module):
    """Blocks checkpointed from outside, as Hugging Face's ``gradient_checkpointing_enable()`` does.

    Under regions each checkpoint body calls the shared block region; Inductor (2.13) then
    wrote a gradient into block 0's weight (Note [Regions under checkpoint]). It needs a
    gradient computed after the blocks' backward with a block weight's shape (``inp``'s).
    """

    def __init__(self, *, reentrant: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(64, 64)
        self.blocks = nn.ModuleList(_Square(64) for _ in range(3))
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.out(x)


BUILDERS.update(
    {
        "repeats": Repeats,
        "checkpoint_around": CheckpointAround,
        "checkpoint_around_reentrant": lambda: CheckpointAround(reentrant=True),
        "compiler_disable": CompilerDisable,
        "disable_nonrecursive": DisableNonRecursive,
        "allow_in_graph": AllowInGraph,
        "disallow_in_graph": DisallowInGraph,
        "is_compiling": IsCompiling,
        "custom_op": CustomOp,
        "func_transforms": FuncTransforms,
        "jacrev": JacRev,
        "numpy": NumpyInForward,
        "checkpoint": Checkpointed,
        "odd_strides": OddStrides,
    }
)


# --- Models that change their own gradients or weights around the graph ---


class ParamHooks(_TwoLayer):
    """Tensor hooks on parameters that change their gradients (a clamp, a per-layer scale):
    the averaged gradient is the hooked one. ``copy.deepcopy`` drops tensor hooks, so each
    copy registers its own (``after_copy``)."""

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h)

    def after_copy(self) -> None:
        self.a.weight.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
        self.b.weight.register_hook(lambda g: g * 3.0)


class Parametrized(nn.Module):
    """``torch.nn.utils.parametrizations`` (weight norm, orthogonal: parameters reached through
    a parametrization's forward) and the old ``spectral_norm`` (a forward pre-hook whose power
    iteration updates its buffers in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(64, 32))
        self.mid = nn.utils.parametrizations.orthogonal(nn.Linear(32, 32))
        self.b = nn.utils.spectral_norm(nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.mid(torch.tanh(self.a(x)))))


class _RoundStraightThrough(torch.autograd.Function):
    """Rounds to a grid in forward, passes the gradient inside a clip range (quantization-aware
    training's straight-through estimator): a backward of the user's own."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, steps: float) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x)  # type: ignore[attr-defined]
        return torch.round(x * steps) / steps

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * (x.abs() < 0.08).to(grad.dtype), None


class StraightThrough(_TwoLayer):
    """A user ``autograd.Function`` on a weight and on activations."""

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(_RoundStraightThrough.apply(h, 4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _RoundStraightThrough.apply(self.a.weight, 64.0)
        return self.b(self.mid(F.linear(x, w, self.a.bias)))


class ComplexWeights(nn.Module):
    """Complex parameters (a spectral mixing layer) beside real ones: DDP's buckets hold a
    complex gradient as its real and imaginary parts, so 16-bit compression rounds both."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(0.1 * torch.randn(33, 16, dtype=torch.complex64))
        self.bias = nn.Parameter(torch.zeros(16, dtype=torch.complex64))
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.fft.rfft(x, dim=-1) @ self.mix + self.bias  # (batch, 16) complex
        return self.head(torch.cat([z.real, z.imag], dim=-1))


class AutocastInside(nn.Module):
    """A bfloat16 autocast region inside forward, with float32 inputs and outputs: compiled and
    eager round it differently (the first-step check takes 16-bit rounding's tolerance)."""

    def __init__(self) -> None:
        super().__init__()
        self.low, self.high = _LNBlock(8, 32), _LNBlock(8, 32)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.low(x)
        return self.head(self.high(h.float()))


class CondBranch(nn.Module):
    """``torch.cond`` in forward: a higher-order operator, compiled even when run eagerly (where
    a dispatch mode around it breaks it, and then later eager calls too)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cond(x.mean() > 0, lambda t: torch.tanh(self.a(t)), lambda t: torch.relu(self.b(t)), (x,))
        return self.head(h)


BUILDERS.update(
    {
        "autocast_inside": AutocastInside,
        "cond_branch": CondBranch,
        "param_hooks": ParamHooks,
        "parametrized": Parametrized,
        "straight_through": StraightThrough,
        "complex_weights": ComplexWeights,
    }
)


class DivergesWhenCompiled(nn.Module):
    """Computes something else under compile: the doctor must flag the first stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h * 1.5 if torch.compiler.is_compiling() else h


@torch.library.custom_op("distcompile_tests::bad_fake", mutates_args=())
def bad_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@bad_fake.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], 3)  # wrong shape: only compiled code sees it


bad_fake.register_autograd(lambda ctx, grad: grad)


class CrashesWhenCompiled(_TwoLayer):
    """Runs eagerly, but its custom op's fake implementation is wrong, so tracing fails."""

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return bad_fake(h)


BUILDERS.update({"diverges": DivergesWhenCompiled, "crashes": CrashesWhenCompiled})


class DropoutKeywords(nn.Module):
    """Dropout in train mode, called with keyword inputs as a Hugging Face model is."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(32, 50)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.drop(self.emb(input_ids))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return self.head(F.gelu(h)).mean()


BUILDERS["dropout_kwargs"] = DropoutKeywords


class StepCounter(nn.Module):
    """Counts its calls in a Python int and scales by it: each call fails the last one's guard."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * (1.0 + 0.01 * self.calls)


class TensorCounter(nn.Module):
    """Counts the samples it saw in a plain tensor attribute (not a buffer), in place: a check
    that runs the forward three times must count once. (Scaling the output by the count would
    meet a torch bug: AOTAutograd's backward reads the count after the write, 8% off under
    plain ``torch.compile`` too; the first-step check reports it.)"""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 8)
        self.seen = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.lin(x)


class InplaceInput(_TwoLayer):
    """Scales its input in place before using it (legal: the caller's tensor changes, once): a
    check that runs the forward three times gives each run its own copy."""

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return super().forward(x)


class NumpyMask(nn.Module):
    """Rows masked at random from NumPy's global generator in forward and replaced by a learned
    vector, as Hugging Face's speech models mask time steps (SpecAugment, wav2vec2's
    ``_compute_mask_indices``). Compiled, TorchDynamo draws those numbers from torch's
    generator unless ``torch._dynamo.config.use_numpy_random_stream`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 16)
        self.masked = nn.Parameter(torch.randn(16))
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.training:
            h[torch.tensor(np.random.rand(h.shape[0]) < 0.4)] = self.masked
        return self.out(F.gelu(h))


class OwnGenerator(_TwoLayer):
    """Noise from a ``torch.Generator`` the module keeps as an attribute (a deterministic
    augmentation): a check that runs the forward three times draws the same noise each time."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(1234)

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h) + 0.1 * torch.randn(h.shape, generator=self.gen)


class GeneratorInput(nn.Module):
    """Noise from a ``generator=`` its caller passes (as diffusers' ``AutoencoderKL`` samples its
    posterior): a check that runs the forward three times draws the same noise each time."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.tanh(h) + 0.1 * torch.randn(h.shape, generator=generator))


class _NormedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.norm = nn.BatchNorm1d(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x)))


class _Meter:
    def __init__(self) -> None:
        self.calls = 0


class PlainStateCounter(nn.Module):
    """Counts its calls in a plain Python object's field and in a dict nested in a dict, and
    ramps its output by them (a warmup schedule kept on the model): a check that runs the
    forward more than once must count once."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 8)
        self.meter = _Meter()
        self.cfg = {"sched": {"calls": 0}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.meter.calls += 1
        self.cfg["sched"]["calls"] += 1
        return self.lin(x) * min(1.0, 0.25 * self.meter.calls) * (1.0 + 0.01 * self.cfg["sched"]["calls"])


class MomentumEncoder(nn.Module):
    """A key encoder of frozen parameters that forward moves toward the trained one (MoCo's
    momentum update, under ``no_grad``): its weight by ``.data =``, its bias in place, a
    ``_foreach_`` update of a second layer. A check that runs the forward more than once must
    move it once."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 32))
        self.key = copy.deepcopy(self.query).requires_grad_(False)
        with torch.no_grad():
            for p in self.key.parameters():
                p.mul_(0.5)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            (kw, kb), (qw, qb) = self.key[0].parameters(), self.query[0].parameters()
            kw.data = kw.data * 0.9 + qw.data * 0.1
            kb.mul_(0.9).add_(qb, alpha=0.1)
            torch._foreach_lerp_(list(self.key[2].parameters()), list(self.query[2].parameters()), 0.1)
            k = self.key(x)
        return self.out(torch.cat([self.query(x), k], 1))


class ScriptedPart(nn.Module):
    """A TorchScript submodule (``torch.jit.script``, as older model code ships them) with
    BatchNorm statistics: TorchDynamo cannot trace it and skips the forward that calls it. Scripted
    in ``after_copy``: a deep copy of a scripted module has parameters that are not leaves (torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.mid: nn.Module = _NormedLinear()
        self.out = nn.Linear(64, 8)

    def after_copy(self) -> None:
        self.mid = torch.jit.script(self.mid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(torch.relu(self.inp(x))))


BUILDERS.update(
    {
        "scripted_part": ScriptedPart,
        "momentum_encoder": MomentumEncoder,
        "plain_state_counter": PlainStateCounter,
        "generator_input": GeneratorInput,
        "own_generator": OwnGenerator,
        "step_counter": StepCounter,
        "tensor_counter": TensorCounter,
        "inplace_input": InplaceInput,
        "numpy_mask": NumpyMask,
    }
)


class _BreakingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()  # inside a repeated block: no nested compile region
        return x + self.b(h)


class BreakInBlocks(nn.Module):
    """Repeated blocks with a graph break inside each: captured again without regions."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_BreakingBlock() for _ in range(3))
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class GraphThenBreakingBlocks(BreakInBlocks):
    """A graph runs first (an input layer, then a graph break), then blocks that cannot be
    regions: the retry without regions reruns a call in which a graph ran (no buffer changed)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        torch._dynamo.graph_break()
        return super().forward(x)


BUILDERS["break_in_blocks"] = BreakInBlocks
BUILDERS["graph_then_breaking_blocks"] = GraphThenBreakingBlocks


class RaisesOnce(nn.Module):
    """A graph runs, then eager code raises at the first call only; repeated blocks follow."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.layers = nn.ModuleList([_Res(64), _Res(64)])
        self.calls = 0

    @torch.compiler.disable
    def _check(self) -> None:
        self.calls += 1
        if self.calls == 1:
            raise ValueError("bad first batch")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        self._check()
        for layer in self.layers:
            h = layer(h)
        return h


class _ScaleWhenCompiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad * 1.5 if torch.compiler.is_compiling() else grad


class GradWrongWhenCompiled(_TwoLayer):
    """Same forward everywhere; the compiled backward scales the first layer's gradients by 1.5."""

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return _ScaleWhenCompiled.apply(h)


BUILDERS["grad_wrong"] = GradWrongWhenCompiled


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x)))


class RoutedMoE(nn.Module):
    """Top-1 routing over four experts, ``out[mask] = expert(h[mask])``: each rank's token counts
    per expert differ, and with ``skip_unused`` so do the experts it calls (a branch on
    ``mask.any()``). Needs ``find_unused_parameters=True`` under eager DDP (the router's
    argmax gives it no gradient)."""

    def __init__(self, skip_unused: bool = False) -> None:
        super().__init__()
        self.skip_unused = skip_unused
        self.inp, self.router = nn.Linear(32, 32), nn.Linear(32, 4)
        self.experts = nn.ModuleList(_Expert() for _ in range(4))
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            mask = choice == i
            if self.skip_unused and not mask.any():
                continue
            out[mask] = expert(h[mask])
        return self.out(out + h)


BUILDERS["moe"] = RoutedMoE
BUILDERS["moe_skip"] = lambda: RoutedMoE(skip_unused=True)


class _ActBlock(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.lin(x))


class UnlikeBlocks(nn.Module):
    """Two blocks of one class, the first holding ``nn.Identity`` where the second holds
    ``nn.ReLU``, after a layer (Note [Regions only for blocks alike]): TorchDynamo reused the
    first block's region trace for the second, which then trained without its ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.blocks = nn.Sequential(_ActBlock(nn.Identity()), _ActBlock(nn.ReLU()))
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


BUILDERS["unlike_blocks"] = UnlikeBlocks


class MaskMoE(nn.Module):
    """Experts chosen by each token's type with boolean masks, ``m = route == e; if m.any():
    out[m] = expert(h[m])``; the type is the input's first column, and each rank sees only
    two of the four types (``batch``), so each rank leaves two experts unused. ``check=False``
    drops the ``m.any()`` test: an expert then runs on no tokens, and with TorchDynamo's
    ``capture_dynamic_output_shape_ops`` the whole forward is one graph with ``nonzero`` in it."""

    def __init__(self, check: bool = True) -> None:
        super().__init__()
        self.check = check
        self.inp = nn.Linear(64, 32)
        self.experts = nn.ModuleList(_Expert() for _ in range(4))
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = x[:, 0].long()
        h = torch.relu(self.inp(x))
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            m = route == e
            if not self.check or m.any():
                out[m] = expert(h[m])
        return self.out(out + h)


BUILDERS["mask_moe"] = MaskMoE
BUILDERS["mask_moe_unchecked"] = lambda: MaskMoE(check=False)


class UnrolledMaskMoE(MaskMoE):
    """``MaskMoE`` with one ``if`` block per expert written out (no loop: TorchDynamo breaks at
    each ``m.any()`` and resumes, and the resumed graph holds ``out[m] = ...``, whose backward
    reads ``grad[m]``, a data-dependent size). Rank ``r`` sees token types 0 to ``r + 1``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = x[:, 0].long()
        h = torch.relu(self.inp(x))
        out = torch.zeros_like(h)
        m = route == 0
        if m.any():
            out[m] = self.experts[0](h[m])
        m = route == 1
        if m.any():
            out[m] = self.experts[1](h[m])
        m = route == 2
        if m.any():
            out[m] = self.experts[2](h[m])
        m = route == 3
        if m.any():
            out[m] = self.experts[3](h[m])
        return self.out(out + h)


BUILDERS["mask_moe_unrolled"] = UnrolledMaskMoE


# --- Models the first-step checks must not break (and one they must catch) ---


class ResizedStat(nn.Module):
    """A statistic kept in a buffer that starts empty and is resized by the first forward (as
    the per-channel observers of quantization-aware training are)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 8)
        self.register_buffer("stat", torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        with torch.no_grad():
            if self.stat.numel() == 0:
                self.stat.resize_(y.shape[1]).copy_(y.abs().amax(0))
            else:
                torch.maximum(self.stat, y.abs().amax(0), out=self.stat)
        return y * 2


class CounterBuffer(nn.Module):
    """A buffer written in forward and read after the write: AOTAutograd (torch 2.13)
    recomputes the read in backward after the write-back, so the compiled gradient is twice
    eager's (an open torch pull request, "Don't recompute reads of mutated inputs")."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 8)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.steps += 1
        return self.lin(x) * (self.steps / 5)


class _LNBlock(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(width), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(F.gelu(self.a(self.ln(x))))


class PartialCheckpoint(nn.Module):
    """Four alike blocks, the second and fourth under ``checkpoint``: TorchDynamo names the
    region traced in the first checkpoint body from the second without holding it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_LNBlock() for _ in range(4))
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        x = torch.utils.checkpoint.checkpoint(self.blocks[1], x, use_reentrant=False)
        x = self.blocks[2](x)
        x = torch.utils.checkpoint.checkpoint(self.blocks[3], x, use_reentrant=False)
        return self.head(x)


class _SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3)
        self.relu, self.flat, self.fc = nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flat(self.relu(self.c2(self.relu(self.c1(x))))))


def qat_eager() -> nn.Module:
    """Eager-mode quantization-aware training: fake-quantized weights and activations, with
    per-channel observers whose min/max buffers start empty."""
    from torch.ao.quantization import get_default_qat_qconfig, prepare_qat

    model = _SmallCNN()
    model.qconfig = get_default_qat_qconfig("x86")
    return prepare_qat(model.train())


def qat_fx() -> nn.Module:
    """FX-mode quantization-aware training (``prepare_qat_fx``)."""
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    model = _SmallCNN().train()
    return prepare_qat_fx(model, get_default_qat_qconfig_mapping("x86"), (torch.randn(2, 3, 8, 8),))


BUILDERS.update(
    resized_stat=ResizedStat,
    counter_buffer=CounterBuffer,
    partial_checkpoint=PartialCheckpoint,
    qat_eager=qat_eager,
    qat_fx=qat_fx,
)
