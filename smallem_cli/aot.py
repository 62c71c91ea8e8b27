"""Ahead-of-time compiled decode steps, cached on disk (`--engine compiled`).

On a CPU a small model's decode step is bound by per-op dispatch and by MKL's small-M
GEMMs, not by arithmetic. Inductor, with max-autotune and frozen weights, replaces both:
one C++ function per step, and a micro-GEMM that stays nearly flat from 1 to 16 rows.
Compiling costs tens of seconds per shape, so each compiled step is packaged with
AOTInductor (a shared library plus its constants) into a folder keyed by everything it
depends on, and later runs load it in a fraction of a second instead of compiling again.

A graph is built for one model, one T (tokens per pass) and one variant (head or not,
last position only or not); the past's length S is a dynamic dimension. The slab's slot
count is part of the key, since the compiled code assumes the strides it was built for:
a model with compiled steps gives its caches the whole context (`fixed_slots`).

Anything that fails (no C++ compiler, an unsupported op, a broken cache entry) turns the
step back to eager, with one line through `log`; the eager path is the reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from . import chain, graphs
from .defaults import PAGE_SIZE
from .native.kernels import ENGINES as NATIVE_BUILDS
from .proposers import Fused, Pass, Proposer
from .steps import MIN_PAST, StepFn, register

Log = Callable[[str], None]
EXAMPLE_PAST = 16  # the past's length while tracing (S is dynamic; any length >= MIN_PAST would do)
INPUTS_VERSION = 2  # bump when the example inputs below (`for_transformer`, `for_mtp`) change layout
# Inductor settings: frozen weights and its C++ GEMM template alone (no ATen choice: its
# small-M GEMMs are what this replaces, and no autotuning means no benchmark to skew on a busy
# machine, and a faster compile). Where the template cannot serve, INDUCTOR_FALLBACK (autotuned).
INDUCTOR = {
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",
    "freezing": True,
    "cpp_wrapper": True,
    "autotune_num_choices_displayed": 0,
}
INDUCTOR_FALLBACK = INDUCTOR | {"max_autotune_gemm_backends": "ATEN,CPP"}


def cache_root() -> Path:
    """$SMALLEM_CACHE, else $XDG_CACHE_HOME/smallem, else ~/.cache/smallem; a leading ~ in either
    is the home folder (as a shell would have it), not a folder named `~`."""
    env = os.environ.get("SMALLEM_CACHE")
    if env:
        return Path(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(os.path.expanduser(xdg)) if xdg else Path.home() / ".cache") / "smallem"


def _fused_version() -> str:
    """The code of the fused graphs (`chain.py`) besides `graphs.py`'s, which `base` holds."""
    return hashlib.sha256(Path(chain.__file__).read_bytes()).hexdigest()[:16]


def _code_version() -> str:
    """What a compiled step depends on besides its model and shape: the graph code, the
    compiler's settings and the example inputs' layout (a change in any makes new keys)."""
    h = hashlib.sha256(Path(graphs.__file__).read_bytes())
    h.update(repr((sorted(INDUCTOR.items()), MIN_PAST, INPUTS_VERSION)).encode())
    return h.hexdigest()[:16]


def weights_digest(tensors: list[torch.Tensor]) -> str:
    """sha256 over the bytes of the graph's constants (a different checkpoint, a different key)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


class CompiledSteps:
    """The compiled decode steps of one model (a Transformer or an MTP module).

    `prepare(shapes)` builds the steps a run will take (before anything is timed);
    `get(T, head, last)` -> a function of the graph's inputs, or None where the step runs
    eager (not prepared, or it failed to compile).
    """

    kind = "compiled"

    def __init__(
        self,
        build: Callable[[bool, bool], nn.Module],
        inputs: Callable[[int], tuple[torch.Tensor, ...]],
        slab_shape: tuple[int, ...],
        rope: tuple[torch.Tensor, torch.Tensor],
        digest: str,
        log: Log | None = None,
        root: Path | None = None,
    ) -> None:
        self.build, self.inputs, self.slab_shape = build, inputs, slab_shape
        self.rope = rope  # cos, sin [context, P]: the graphs' rotary inputs, position by position
        self.positions = rope[0].shape[0]  # the context: no pass may reach past it
        self.min_past = MIN_PAST  # the tracer special-cases a past of 0 or 1 positions
        self.in_place = False  # the graph returns the new K/V; the caller writes them
        self.log = log or (lambda _: None)
        self.root = root or cache_root()
        self.base = "|".join(
            [
                _code_version(),
                torch.__version__,
                torch.backends.cpu.get_cpu_capability(),
                str(slab_shape),
                digest,
            ]
        )
        self.fns: dict[tuple[int, bool, bool], StepFn | None] = {}
        self.fns_fused: dict[str, StepFn | None] = {}  # a proposer's own graphs, by name
        self.enabled = True  # off: the model runs eager (bench times both engines on one model)
        register(self)
        self.compile_s = 0.0  # seconds spent compiling in this process
        self.load_s = 0.0  # seconds spent loading packages from the cache

    def key(self, T: int, head: bool, last: bool) -> str:
        # The generated C++ fixes its OpenMP thread count: a step built for 2 threads is not one for 1.
        threads = torch.get_num_threads()
        return hashlib.sha256(f"{self.base}|{threads}|{T}|{head}|{last}".encode()).hexdigest()[:32]

    def trig(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, P] of a pass's new positions, start .. length - 1."""
        return self.rope[0][start:length], self.rope[1][start:length]

    def get(self, T: int, head: bool, last: bool) -> StepFn | None:
        """The prepared step for this pass, or None: nothing is compiled in the middle of a run."""
        return self.fns.get((T, head, last and T > 1))

    def prepare(self, shapes: list[tuple[int, bool, bool]], build: bool = True) -> int:
        """Load the steps of these passes, (T, head, last), from the cache; with `build`, compile
        those it lacks first. -> how many of them are ready."""
        for T, head, last in shapes:
            shape = (T, head, last and T > 1)
            if self.fns.get(shape) is None and (build or shape not in self.fns):
                key, run = self.key(*shape), shape

                def compile_to(path: Path, s: tuple[int, bool, bool] = run) -> None:
                    self._compile(s[0], self.build(s[1], s[2]), self.inputs(s[0]), path)

                self.fns[shape] = self._load_or_compile(key, f"T={T}", compile_to, build)
        return sum(self.get(*shape) is not None for shape in shapes)

    def fused(self, name: str) -> StepFn | None:
        """A prepared fused graph (`prepare_fused`), or None: the step-by-step path."""
        return self.fns_fused.get(name) if self.enabled else None

    def prepare_fused(self, fused: Fused, build: bool = True) -> bool:
        """Load a graph of the proposer's own (`Proposer.fused`), compiling it first with `build`."""
        name, T, module, inputs = fused
        if self.fns_fused.get(name) is None and (build or name not in self.fns_fused):
            threads = torch.get_num_threads()
            key = hashlib.sha256(f"{self.base}|{threads}|{_fused_version()}|{name}".encode()).hexdigest()[:32]

            def compile_to(path: Path) -> None:
                self._compile(T, module(), inputs(), path)

            self.fns_fused[name] = self._load_or_compile(key, name, compile_to, build)
        return self.fns_fused[name] is not None

    def _load_or_compile(
        self, key: str, what: str, compile_to: Callable[[Path], None], build: bool = True
    ) -> StepFn | None:
        path = self.root / "aot" / f"{key}.so"
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            _check_private(path.parent)
            if not path.is_file():
                if not build:
                    return None
                t0 = time.perf_counter()
                self.log(f"compiling a decode step for this machine ({what}; once, cached in {self.root})")
                compile_to(path)
                self.compile_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            # The library alone, loaded as it lies: `aoti_load_package` would unpack the whole
            # package into a temporary folder first (3 s for the target's step, against 0.05 s).
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
            self.load_s += time.perf_counter() - t0
            return lambda *args: tuple(runner.run(list(args)))
        except Exception as e:  # any failure: eager, which is always right
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            self.log(f"compiled decode step unavailable ({what}): {type(e).__name__}: {first}; running eager")
            return None

    def _compile(self, T: int, module: nn.Module, inputs: tuple[torch.Tensor, ...], path: Path) -> None:
        """Export a graph of (*inputs, cos, sin, past) with the past's length S dynamic, traced
        with a past of EXAMPLE_PAST positions and T positions after it; compile it, and move
        its library into place whole."""
        S0 = EXAMPLE_PAST
        cos, sin = (t[S0 : S0 + T] for t in self.rope)
        slab = torch.zeros(self.slab_shape)  # the runtime slab's layout: same strides
        args = (*inputs, cos, sin, slab[:, :, :, :S0])
        S = torch.export.Dim("S", min=MIN_PAST, max=self.slab_shape[-2] - T)
        dyn = tuple({3: S} if i == len(args) - 1 else {} for i in range(len(args)))
        module = module.eval()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=path.parent))
        try:
            with torch.no_grad(), _quiet(path.with_suffix(".log")):
                ep = torch.export.export(module, args, dynamic_shapes=dyn)
                try:
                    out = torch._inductor.aoti_compile_and_package(
                        ep, package_path=str(tmp / "step.pt2"), inductor_configs=dict(INDUCTOR)
                    )
                except Exception:  # the template cannot serve some product: let ATen's compete
                    out = torch._inductor.aoti_compile_and_package(
                        ep, package_path=str(tmp / "step.pt2"), inductor_configs=dict(INDUCTOR_FALLBACK)
                    )
            with zipfile.ZipFile(out) as z:  # the package's one shared library (its weights inside)
                (lib,) = [n for n in z.namelist() if n.endswith(".so")]
                z.extract(lib, tmp)
            os.replace(tmp / lib, path)  # another process may have built the same key: either is whole
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _check_private(folder: Path) -> None:
    """A package is a shared library that gets loaded: only from a folder nobody else can write to."""
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{folder} is writable by others or not yours: its compiled steps are not loaded")


@contextlib.contextmanager
def _quiet(log_path: Path) -> Iterator[None]:
    """The compiler's own output (its warnings, the C++ compiler's) goes to a log file, not the terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log_path, "w") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def for_transformer(model: graphs.Transformer, log: Log | None = None, root: Path | None = None) -> CompiledSteps:
    """Compiled steps of a packed Transformer, whose caches get `fixed_slots` slots."""
    c = model.cfg
    assert model.rope_cos is not None and model.rope_sin is not None
    slab = (c.n_layers, 2, c.n_kv_heads, fixed_slots(c.max_seq_len), c.head_dim)
    consts = [model.embed_tokens.weight, model.head_t] + [w for b in model.layers for w in b.packed.values()]  # type: ignore[union-attr]
    return CompiledSteps(
        lambda head, last: graphs.TransformerStep(model, head, last),
        lambda T: (torch.zeros(T, dtype=torch.long),),  # tokens; then cos, sin and the past
        slab,
        (model.rope_cos, model.rope_sin),
        weights_digest(consts),
        log,
        root,
    )


def for_mtp(
    mtp: graphs.MTPModule, target: graphs.Transformer, log: Log | None = None, root: Path | None = None
) -> CompiledSteps:
    """Compiled steps of a packed MTP module (its table built from the target's embedding)."""
    c = mtp.cfg
    assert target.rope_cos is not None and target.rope_sin is not None and mtp.proj_t is not None
    embed = target.embed_tokens.weight
    slab = (1, 2, c.n_kv_heads, fixed_slots(c.max_seq_len), c.head_dim)
    n = min(c.max_seq_len, target.cfg.max_seq_len)
    consts = [embed, mtp.proj_t, *mtp.block.packed.values()]  # what the table is made of: no matmul's rounding  # type: ignore[union-attr]
    return CompiledSteps(
        lambda head, last: graphs.MTPStep(mtp, embed, last),
        lambda T: (torch.zeros(T, c.dim), torch.zeros(T, dtype=torch.long)),  # h, tokens; then cos, sin, past
        slab,
        (target.rope_cos[:n], target.rope_sin[:n]),
        weights_digest(consts),
        log,
        root,
    )


def fixed_slots(max_seq_len: int, page_size: int = PAGE_SIZE) -> int:
    """Slots of every cache of a model with compiled steps: its whole context, plus a page."""
    return (-(-max_seq_len // page_size) + 1) * page_size


def attach(
    model: graphs.Transformer | graphs.MTPModule, target: graphs.Transformer | None = None, log: Log | None = None
) -> None:
    """Give a packed model (an MTP module: with its target) compiled decode steps."""
    if isinstance(model, graphs.MTPModule):
        assert target is not None, "an MTP module's steps need its target"
        model.compiled = for_mtp(model, target, log)
    else:
        model.compiled = for_transformer(model, log)


def prepare(
    target: graphs.Transformer,
    proposer: Proposer,
    ks: list[int],
    log: Log | None = None,
    build: bool = True,
    also: tuple[int, ...] = (),
    greedy: bool = True,
) -> tuple[int, int]:
    """Compiled steps for the target and the proposer's models: every pass a run with these k
    may take (and target passes over the token counts `also`; the proposer's own graphs for
    greedy or sampled runs), loaded now (and with `build`,
    compiled first where the cache lacks it), before anything is timed.
    -> (passes with a compiled step, passes)."""
    sizes = sorted({m + 1 for k in ks for m in proposer.counts(k)} | {T for T in also})
    passes: list[Pass] = [(target, T, True, False) for T in sizes]  # verify passes over m+1 tokens
    for k in ks:
        passes += proposer.passes(k)
    ready = 0
    for model, T, head, last in passes:
        if getattr(model, "compiled", None) is None:
            attach(model, target, log)  # type: ignore[arg-type]
        ready += model.compiled.prepare([(T, head, last)], build)  # type: ignore[union-attr]
    fused = [f for k in ks for f in proposer.fused(k, greedy)]
    for model, graph in fused:
        if getattr(model, "compiled", None) is None:
            attach(model, target, log)  # type: ignore[arg-type]
        ready += model.compiled.prepare_fused(graph, build)  # type: ignore[union-attr]
    return ready, len(passes) + len(fused)


def use(models: list[nn.Module], compiled: bool) -> None:
    """Switch models with compiled steps between them and the eager path."""
    for m in models:
        steps = getattr(m, "compiled", None)
        if steps is not None:
            steps.enabled = compiled


NATIVE = tuple(NATIVE_BUILDS)  # the native engine's builds: the widest this CPU runs, and its AVX2 one
ENGINES = ("auto", "eager", "compiled", *NATIVE)
BENCH_ENGINES = ("eager", "compiled", *NATIVE[::-1])  # slowest first: the AVX2 build before the widest


def fastest(engines: Iterable[str]) -> str:
    """The fastest of these engines (by BENCH_ENGINES' order): the one a peer is compared with."""
    given = set(engines)
    return next((e for e in reversed(BENCH_ENGINES) if e in given), "eager")


def engine_mode(engine: str, device: torch.device) -> str | None:
    """--engine -> None (eager), "build" (compiled: load inductor's steps, building what the
    cache lacks), "native" (`native/`; auto on a CPU) or "native-avx2" (its AVX2 build).
    ValueError for an unknown name, or an engine for a CPU on another device."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: use {', '.join(ENGINES)}")
    if engine in ("compiled", *NATIVE) and device.type != "cpu":
        raise ValueError(f"--engine {engine} runs on a CPU only (it has not been run on a GPU): use eager there")
    if engine == "compiled":
        return "build"
    if engine == "auto":
        return "native" if device.type == "cpu" else None
    return engine if engine in NATIVE else None


def prepare_engine(
    mode: str | None,
    target: graphs.Transformer,
    proposer: Proposer,
    ks: list[int],
    log: Log | None = None,
    greedy: bool = True,
) -> tuple[int, int]:
    """Load (or build) what `engine_mode`'s mode runs, before anything is timed ->
    (passes or models ready, of how many). None: eager, nothing to do."""
    if mode in NATIVE:
        from . import native  # its kernels are built by the system's compiler, once

        models = [m for k in ks for m, *_ in proposer.passes(k)]
        return native.prepare(target, models, log or (lambda _: None), cache_root(), mode)  # type: ignore[arg-type]
    if mode is None:
        return 0, 1
    return prepare(target, proposer, ks, log, build=mode == "build", greedy=greedy)


def bench_engines(engines: str, device: torch.device) -> tuple[str, ...]:
    """--engines of bench: "auto" or a comma-separated list of eager, compiled, native-avx2 and native."""
    if engines == "auto":
        return ("eager", "native") if engine_mode("auto", device) else ("eager",)
    names = tuple(dict.fromkeys(e.strip() for e in engines.split(",") if e.strip()))
    if not names or any(e not in BENCH_ENGINES for e in names):
        raise ValueError(f"--engines takes {', '.join(BENCH_ENGINES)} (comma-separated), or auto; got {engines!r}")
    return names
