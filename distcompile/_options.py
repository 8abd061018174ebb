"""distcompile's options, one small frozen dataclass per concern; ``Config`` holds one of each.

- ``CompileOptions``: how segments are compiled, and recompiled.
- ``CommunicationOptions``: buckets, compression, how gradients travel.
- ``CheckOptions``: the checks, and how long ranks wait for each other.
- ``TelemetryOptions``: what is measured and written down.

Every option is documented once, in its group's docstring. An option given to the wrong
group is a ``ConfigError`` naming the right one.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ConfigError

__all__ = [
    "BACKENDS",
    "COMPRESSIONS",
    "GROUPS",
    "check_caps",
    "CheckOptions",
    "CommunicationOptions",
    "CompileOptions",
    "TelemetryOptions",
    "group_of",
    "hint",
]

#: Inner compilers a segment can be compiled with, in debugging-ladder order.
BACKENDS = ("eager", "aot_eager", "inductor")
#: Gradient compression formats for the all-reduce.
COMPRESSIONS = (None, "fp16", "bf16")


def _guarded(cls: type) -> type:
    """``cls(**options)`` raises ``ConfigError`` naming where each option it lacks belongs."""
    init: Callable = cls.__init__  # type: ignore[misc]

    def __init__(self: object, **options: object) -> None:
        mine = {f.name for f in dataclasses.fields(cls)}
        wrong = sorted(set(options) - mine)
        if wrong:
            raise ConfigError(
                f"{cls.__name__} has no option(s) {wrong}: "
                + "; ".join(hint(name, mine) for name in wrong)
                + f". Its options are {sorted(mine)}."
            )
        init(self, **options)

    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__  # type: ignore[misc]
    return cls


class _Group:
    """What every group has: ``replace``."""

    __slots__ = ()

    def replace(self, **changes: object) -> _Group:
        """A copy with ``changes`` applied and validated."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def _check_fields(options: object) -> None:
    for field in dataclasses.fields(options):  # type: ignore[arg-type]
        _check_type(field.name, getattr(options, field.name), str(field.type))


@_guarded
@dataclass(kw_only=True, slots=True, frozen=True)
class CompileOptions(_Group):
    """How each graph segment is compiled and when it is compiled again. ``Config.compile``; each option may also be given to ``wrap`` or ``Config`` by name.

    Attributes:
        backend: Compiler for each graph segment: ``"inductor"`` (fused C++/Triton
            kernels), ``"aot_eager"`` (AOTAutograd without code generation) or ``"eager"``
            (Dynamo capture only). Walk this ladder when debugging.
        mode: Inductor's preset, as in ``torch.compile`` (``"default"``,
            ``"max-autotune-no-cudagraphs"``, ...; inductor backend only). CUDA graphs
            follow ``cudagraphs`` alone, so ``"max-autotune"`` runs without them unless
            ``cudagraphs=True``, and ``"reduce-overhead"`` (which means CUDA graphs) is
            spelled ``cudagraphs=True``.
        fullgraph: Raise if TorchDynamo has to break the graph, as in ``torch.compile``.
        dynamic: As in ``torch.compile``: ``None`` (automatic: a shape that changes is
            recompiled once as dynamic), ``True`` (every dimension dynamic from the first
            compile) or ``False`` (never dynamic: every new shape recompiles).
        cudagraphs: Record each segment in a CUDA graph. CUDA only.
        regions: Trace each class of repeated block once (the layers of an
            ``nn.ModuleList`` or ``nn.Sequential``, as TorchDynamo's nested compile
            regions) and copy that trace for the other blocks whose inputs and guards
            match; the graph planned and compiled is the same. A capture TorchDynamo
            cannot do that way (a graph break inside a block, dynamic shapes on some
            models) is done again without regions. ``False``, or ``dynamic=True``: trace
            every block.
        share_compiles: Split each graph's distinct pieces between the ranks, each compiled
            once in the job: through Inductor's cache folder for ranks that share one,
            through the job's store for the others (Note [Sharing compiles between
            ranks], Note [Compiles shared across cache folders]). ``False``: every rank
            compiles every piece itself. Inductor only.
        recompile: ``"allow"`` recompiles (each one is logged with the guard that
            failed) or ``"error"``: after the first synchronized step, a recompile raises
            :class:`distcompile.RecompileError` naming the guard, for latency-critical runs.
    """

    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    cudagraphs: bool = False
    regions: bool = True
    share_compiles: bool = True
    recompile: str = "allow"

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"backend={self.backend!r} is not one of {BACKENDS}; distcompile compiles each "
                "segment itself and supports only these. Use backend='inductor' for speed or "
                "'aot_eager'/'eager' to debug."
            )
        if self.recompile not in ("allow", "error"):
            raise ConfigError(f"recompile={self.recompile!r} must be 'allow' or 'error'.")
        if self.cudagraphs and self.backend != "inductor":
            raise ConfigError(f"cudagraphs=True needs backend='inductor', got backend={self.backend!r}.")
        if self.mode is not None:
            self._check_mode()

    def _check_mode(self) -> None:
        from ._torch_compat import inductor_modes  # imports Inductor: only when a mode is given

        if self.backend != "inductor":
            raise ConfigError(
                f"mode={self.mode!r} is an Inductor preset and backend={self.backend!r} does not use it. "
                "Drop mode= (or use backend='inductor')."
            )
        if self.mode == "reduce-overhead":
            raise ConfigError(
                "mode='reduce-overhead' means CUDA graphs, which distcompile records per segment: pass "
                "cudagraphs=True instead (CUDA models only)."
            )
        modes = inductor_modes()
        if self.mode not in modes:
            raise ConfigError(f"mode={self.mode!r} is not one of Inductor's presets {sorted(modes)}.")


@_guarded
@dataclass(kw_only=True, slots=True, frozen=True)
class CommunicationOptions(_Group):
    """How gradients are bucketed and all-reduced. ``Config.communication``; each option may also be given to ``wrap`` or ``Config`` by name.

    Attributes:
        bucket_cap_mb: Gradient bucket size in MiB. ``None`` takes the DDP model's
            ``bucket_cap_mb`` (25 MiB for a plain module). ``"auto"`` measures the link
            (all-reduce latency and bandwidth) and the compute rate when ``wrap`` runs,
            counts each graph node's FLOPs, and chooses the segments and buckets whose
            simulated step is shortest: communication starts early and the bucket that
            can only go after backward (the first layer's parameters) stays small. The
            measurement is kept next to Inductor's cache and reused while new ones stay
            within 3x, so a restarted job plans alike and hits the compile cache.
        first_bucket_cap_mb: Size of the first bucket in gradient order, which is kept
            small so communication starts early. ``None`` follows DDP: 1 MiB when the
            bucket cap is DDP's default, else the bucket cap.
        compression: ``None`` (all-reduce in the gradient dtype), ``"bf16"`` or
            ``"fp16"``: gradients are cast into a half-precision bucket, averaged, and
            cast back. ``None`` also inherits a DDP model's registered fp16/bf16 hook.
        compression_scope: ``"all"`` compresses every bucket; ``"tail"`` only the
            buckets that can only be all-reduced after backward ends (the parameters of
            the first forward ops, such as embeddings, plus parameters no graph read).
            The other buckets overlap backward at full precision, so ``"tail"`` shortens
            the exposed communication while rounding only those gradients.
        gradient_as_bucket_view: Leave ``param.grad`` as a view into its bucket (saves
            one copy and the memory of one gradient set). ``None`` takes the DDP
            model's setting (``False`` for a plain module).
        broadcast_buffers: Broadcast buffers from rank 0 before each training forward,
            as DDP does. ``None`` takes the DDP model's setting (``True`` for a plain module).
        split_shared: Reduce each use of a shared parameter apart (a tied embedding's output
            projection early in backward, its lookup at the end) and an embedding table's
            tail by the rows looked up, when cheaper (Note [Shared weights reduced by
            use]). Off under a communication hook and with CUDA graphs (``cudagraphs``,
            ``mode="reduce-overhead"``). ``False``: one reduction per parameter, as DDP.
    """

    bucket_cap_mb: float | str | None = None
    first_bucket_cap_mb: float | None = None
    compression: str | None = None
    compression_scope: str = "all"
    gradient_as_bucket_view: bool | None = None
    broadcast_buffers: bool | None = None
    split_shared: bool = True

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.bucket_cap_mb == "auto":
            if self.first_bucket_cap_mb is not None:
                raise ConfigError(
                    f"first_bucket_cap_mb={self.first_bucket_cap_mb!r} has no effect with "
                    "bucket_cap_mb='auto', which sizes every bucket from measured costs. Drop one of them."
                )
        elif isinstance(self.bucket_cap_mb, str):
            raise ConfigError(
                f"bucket_cap_mb={self.bucket_cap_mb!r} must be a positive number of MiB, None (DDP's "
                "setting) or 'auto' (chosen from measured link and compute speed)."
            )
        check_caps(bucket_cap_mb=self.bucket_cap_mb, first_bucket_cap_mb=self.first_bucket_cap_mb)
        if self.compression not in COMPRESSIONS:
            raise ConfigError(
                f"compression={self.compression!r} is not supported; use one of {COMPRESSIONS}."
            )
        if self.compression_scope not in ("all", "tail"):
            raise ConfigError(f"compression_scope={self.compression_scope!r} must be 'all' or 'tail'.")
        if self.compression_scope == "tail" and self.compression is None:
            raise ConfigError(
                "compression_scope='tail' needs a compression format to apply to the tail; pass "
                "compression='bf16' (or 'fp16') too."
            )


@_guarded
@dataclass(kw_only=True, slots=True, frozen=True)
class CheckOptions(_Group):
    """What is checked, and how long ranks wait for each other. ``Config.checks``; each option may also be given to ``wrap`` or ``Config`` by name.

    Attributes:
        check_params: At wrap time, check that every rank holds the same parameter
            values (a rank that loaded other weights would silently train apart) and raise
            :class:`distcompile.DesyncError` naming the parameters that differ.
        detect_nonfinite: After each step's all-reduce, check the gradients for NaN/Inf
            and raise :class:`distcompile.NonFiniteGradientError` naming the step, bucket
            and parameters (one reduction per bucket).
        verify: ``"forward"`` (the default): on the first training step and the first after
            each recompile, run the forward eagerly, as captured and compiled from the same
            state and compare the outputs (Note [First-step forward check] in
            ``runtime/forward_check.py``; two more forwards in those steps, no backward); a
            difference raises :class:`distcompile.VerificationError` naming the graphs and
            the regions in use. ``True``: the full check against eager DDP in the same steps
            (Note [First-step self-check] in
            ``runtime/verify.py``): gradients within ``verify_tolerance``, parameters
            untouched by backward, buffers and outputs alike, ranks in agreement; a
            difference raises :class:`distcompile.VerificationError` naming the graph,
            segment and parameter. A checked step holds a copy of the model and runs it
            eagerly beside the compiled one (memory and time: see the Note); other steps
            cost nothing. Inductor then draws random numbers from torch's generator
            (``fallback_random``), as eager does, so that dropout masks are the same.
            ``False``: no check.
        verify_tolerance: Largest difference ``verify`` accepts, relative to the largest
            eager value (a parameter's gradient, an output). ``None``: 1e-3 (1e-4 for the
            captured forward), or 2e-2 in float16 precision (half-precision parameters,
            autocast, compression) and 1e-1 where the forward computes in bfloat16.
        desync_timeout_s: Seconds to wait for every rank to publish its plan before
            raising :class:`distcompile.DesyncError`.
    """

    check_params: bool = True
    detect_nonfinite: bool = False
    verify: bool | str = "forward"
    verify_tolerance: float | None = None
    desync_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.verify not in (True, False, "forward"):
            raise ConfigError(
                f"verify={self.verify!r}: use 'forward' (the default first-step check of the forward), "
                "True (the full check against eager DDP, gradients included) or False (no check)."
            )
        if self.verify_tolerance is not None and not self.verify_tolerance > 0:
            raise ConfigError(f"verify_tolerance={self.verify_tolerance!r} must be > 0 (or None).")
        if not self.desync_timeout_s > 0:
            raise ConfigError(f"desync_timeout_s={self.desync_timeout_s!r} must be > 0 seconds.")


@_guarded
@dataclass(kw_only=True, slots=True, frozen=True)
class TelemetryOptions(_Group):
    """What is measured and written down (``logdir``). ``Config.telemetry``; each option may also be given to ``wrap`` or ``Config`` by name.

    Attributes:
        logdir: Directory for telemetry: TensorBoard scalars, text and a timeline picture
            (rank 0's), and Chrome traces of every rank under ``logdir/traces``. ``None``
            measures and writes nothing.
        trace_every: Write each rank's Chrome trace every this many steps (0: never).
            ``None`` (the default): steps 0 (it compiles) and 10, then every 100th, of
            which each rank keeps steps 0 and 10 and its newest 10 files. A trace costs the
            host a few milliseconds. Scalars are written every step.
        figure_every: Add a Gantt picture of a step to TensorBoard: the first step after
            warm-up (the first that compiled nothing), then every this many steps (0: never).
            ``None`` (the default): the first, then as often as keeps drawing under 2% of
            the time in steps (one takes 0.1-0.4 s: about one a minute of steps at most).
        telemetry_all_ranks: Give every rank its own TensorBoard run (``logdir/rank{R}``)
            instead of rank 0 alone.
    """

    logdir: str | os.PathLike | None = None
    trace_every: int | None = None
    figure_every: int | None = None
    telemetry_all_ranks: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.logdir is not None:  # one spelling downstream; a pathlib.Path is welcome here
            object.__setattr__(self, "logdir", os.fspath(self.logdir))
        for name in ("trace_every", "figure_every"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 0 (0 turns it off).")


#: Group name in ``Config`` -> its dataclass.
GROUPS: dict[str, type] = {
    "compile": CompileOptions,
    "communication": CommunicationOptions,
    "checks": CheckOptions,
    "telemetry": TelemetryOptions,
}
_GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}


def check_caps(**caps: object) -> None:
    """Raise ``ConfigError`` for a bucket cap that is not a positive number of MiB (``None`` and
    ``"auto"`` pass: their meaning is the caller's).

    Example:
        >>> check_caps(bucket_cap_mb=25, first_bucket_cap_mb=None)
        >>> check_caps(bucket_cap_mb=-1)
        Traceback (most recent call last):
        ...
        distcompile.errors.ConfigError: bucket_cap_mb=-1 must be a positive number of MiB (or None).
    """
    for name, value in caps.items():
        if value is not None and value != "auto" and not value > 0:  # type: ignore[operator]
            raise ConfigError(f"{name}={value!r} must be a positive number of MiB (or None).")


def group_of(option: str) -> str | None:
    """The group (``Config`` attribute) that holds ``option``, or ``None``.

    Example:
        >>> group_of("bucket_cap_mb"), group_of("nope")
        ('communication', None)
    """
    return _GROUP_OF.get(option)


#: Options people pass to ``wrap`` that belong to another object, and where they go.
_ELSEWHERE = {
    **dict.fromkeys(
        (
            "find_unused_parameters",
            "static_graph",
            "device_ids",
            "output_device",
            "process_group",
            "init_sync",
            "delay_all_reduce_named_params",
            "mixed_precision",
            "skip_all_reduce_unused_params",
        ),
        "DistributedDataParallel's option: pass it to DDP(model, {name}=...) and wrap that model, "
        "whose options distcompile takes over",
    ),
    "options": "torch.compile's Inductor options: set them with torch._inductor.config.patch(...) around "
    "the first step, or in torch._inductor.config",
    "disable": "torch.compile's switch: to run without compiling, train the DDP model without wrap() "
    "(or backend='eager' to keep distcompile's buckets)",
}


def hint(name: str, options: set[str] | None = None) -> str:
    """Where an unknown option ``name`` belongs: another group, another object, or the option
    of ``options`` (default: all) it most looks like.

    Example:
        >>> hint("bucket_cap")
        "'bucket_cap': did you mean 'bucket_cap_mb'?"
    """
    if name in _ELSEWHERE:
        return f"{name!r} is {_ELSEWHERE[name].format(name=name)}"
    group = group_of(name)
    if group is not None and options is not None:
        return f"{name!r} belongs to {GROUPS[group].__name__} (Config.{group}), or pass it by name to wrap/Config"
    close = difflib.get_close_matches(name, sorted(options or _GROUP_OF), n=1, cutoff=0.6)
    return f"{name!r}: did you mean {close[0]!r}?" if close else f"{name!r} is not an option of distcompile"


#: Annotation name -> (accepted types, how the error message says it).
_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "bool": ((bool,), "True/False"),
    "int": ((numbers.Integral,), "an integer"),
    "float": ((numbers.Real,), "a number"),
    "str": ((str,), "a string"),
    "None": ((type(None),), "None"),
    "os.PathLike": ((os.PathLike,), "a path"),
}


def _check_type(name: str, value: object, annotation: str) -> None:
    # The annotation is the contract ("float | str | None"); ``bool`` is an int to Python,
    # but ``bucket_cap_mb=True`` or ``trace_every=False`` is a mistake, not a number.
    names = [n.strip() for n in annotation.split("|")]
    allowed = tuple(t for n in names for t in _TYPES[n][0])
    is_bool = isinstance(value, bool)
    if isinstance(value, allowed) and (not is_bool or "bool" in names):
        return
    raise ConfigError(
        f"{name}={value!r} ({type(value).__name__}) has the wrong type: {name} takes "
        f"{' or '.join(_TYPES[n][1] for n in names)}."
    )
