"""The launch layer: every kernel launch goes through `launch`, and a public op's launches can be recorded once
and replayed with new tensors.

Why: Triton's JIT launch (`kernel[grid](...)`) binds and specialises every argument on every call (~60 for the
attention kernel), and the launchers around it compute strides, tiles and TMA descriptors again each time: 250-640
us of host time per eager call on the GPU machine, for kernels that run 14 us. A public op therefore keys each call
on its *signature* (every tensor's shape, strides, dtype, device and 16-byte alignment, every scalar argument;
`tensor_key`). The first call of a signature runs the Python launchers as before inside `record(slots)`, which
keeps, for every launch, the compiled kernel's own launcher (what Triton's JIT ends in) and the full argument list
with each tensor replaced by a reference to the slot it came from. Later calls of that signature call `replay`:
the same launchers, the same constant arguments, only the pointers of this call's tensors. Everything Triton
specialises on (dtypes, constexprs, integers equal to 1 or divisible by 16, pointer alignment) is a function of the
signature, so a call whose alignment or strides differ has another key: it records its own launches and Triton
compiles or picks the matching variant.

A tensor a launcher passes to a kernel must be a slot (identity) or be registered with `derived` (a view of a slot,
a TMA descriptor over one): recording refuses any other tensor, so a per-call buffer can never be baked into a
replay. Under Triton's interpreter (`TRITON_INTERPRET=1`) nothing is recorded and launches are plain; so too with
`TILEFLASH_DIRECT_LAUNCH=0` (the comparison point of the tests and `bench host`).
"""
from __future__ import annotations

import functools
import inspect
import os
import threading

import torch
from triton import knobs
from triton.runtime.errors import OutOfResources

from .. import _utils

ENABLED = os.environ.get("TILEFLASH_DIRECT_LAUNCH", "1") != "0" and not _utils.is_interpreter()
MAX_PLANS = 4096  # per op; a cache past this is emptied (shapes that never repeat, e.g. growing prefixes)

_state = threading.local()
_SLOT, _PTR, _DESC = 0, 1, 2


def tensor_key(t):
    """What a launch may depend on in a tensor besides its values: None for an absent argument."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15


def optional_keys(*tensors) -> tuple:
    """tensor_key of each optional tensor argument, or () when none is given (a common call's key stays short to
    build and hash)."""
    for t in tensors:
        if t is not None:
            return tuple(map(tensor_key, tensors))
    return ()


class _Ptr:
    """A pointer stand-in for a TMA descriptor's base at an offset from its slot (the launcher reads data_ptr())."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


def _raw_launcher(compiled):
    """(Triton's C launcher, the descriptors' metadata by argument position, the call convention) for a compiled
    kernel, or None where this triton's launcher is not the shape this was written against (3.6, 3.7) or needs
    scratch memory: then CudaLauncher.__call__ runs as usual. Without descriptor arguments the C launcher is
    CudaLauncher.launch itself (a replay skips __call__'s Python: ~1 us a launch on the CPU stand-in); with them it
    sits in the closure of the TMA-descriptor wrapper."""
    launcher = compiled.run
    inner = getattr(launcher, "launch", None)
    if inner is None or launcher.global_scratch_size or launcher.profile_scratch_size:
        return None
    if getattr(inner, "__closure__", None) is None:  # no descriptor wrapper: the C launcher itself
        return inner, {}, _launcher_convention()
    cells = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__)))
    raw, meta, indices = cells.get("launcher"), cells.get("tensordesc_meta"), cells.get("tensordesc_indices")
    if raw is None or not meta or indices is None or any(m is None for m in meta):
        return None
    return raw, dict(zip(sorted(indices), meta)), _launcher_convention()


@functools.lru_cache(maxsize=None)
def _launcher_convention() -> str:
    """How Triton's CudaLauncher calls its C launcher: "3.7" (kernel arguments as one list after annotations and
    signature) or "3.6" (kernel arguments spread after the hooks)."""
    from triton.backends.nvidia.driver import CudaLauncher

    return "3.7" if "kernel_metadata" in inspect.signature(CudaLauncher.__call__).parameters else "3.6"


class _TensorMaps(dict):
    """A descriptor argument's expansion (Triton's make_tensordesc_arg: the encoded CUtensorMap, shape, strides) by
    base pointer: its shape, strides and block are the recorded ones, so the pointer decides the map. Engines pass
    the same caches every step, so the encoding (and its Python) is paid once per tensor."""

    def __init__(self, cls, fields, meta):
        super().__init__()
        self.cls, self.fields, self.meta = cls, fields, meta

    def miss(self, ptr: int):
        from triton.backends.nvidia import driver as nvidia_driver

        desc = self.cls.__new__(self.cls)
        desc.__dict__.update(self.fields)
        desc.base = _Ptr(ptr)
        if len(self) >= 64:
            self.clear()
        expanded = self[ptr] = tuple(nvidia_driver.make_tensordesc_arg(desc, self.meta))
        return expanded


class _Launch:
    """One recorded launch: the compiled kernel's launcher and its arguments, slots substituted per call. The
    argument tuple is built by generated code (one expression per argument), so a replay costs about what the
    launcher itself does; TMA descriptors go to Triton's C launcher already encoded (_TensorMaps)."""

    def __init__(self, compiled, grid: tuple, args: list, subs: tuple):
        self.compiled, self.grid = compiled, grid
        run = compiled.run
        env = {"run": run, "function": compiled.function, "metadata": compiled.packed_metadata,
               "compiled": compiled, "grid": grid, "_Ptr": _Ptr}
        by_pos = {pos: (kind, slot, extra) for pos, kind, slot, extra in subs}
        raw = _raw_launcher(compiled)
        if raw is not None and not raw[1] and any(hasattr(value, "block_shape") for value in args):
            raw = None  # descriptors, but no wrapper to read their metadata from: the launcher as the JIT calls it
        # Pointers go to Triton's C launcher as ints, each slot's read once: for a tensor it calls data_ptr() and
        # cuPointerGetAttribute per argument (a decode launch has ~25 pointer arguments, most of them constants).
        pointers = sorted({slot for _, kind, slot, _ in subs if kind != _DESC or raw is not None})
        pre, exprs = [f"    s{slot} = slots[{slot}].data_ptr()" for slot in pointers], []
        for pos, value in enumerate(args):
            if pos not in by_pos:
                if value is None or type(value) in (int, bool):
                    exprs.append(repr(value))
                elif raw is not None and pos in raw[1]:  # a descriptor over a constant: encoded once
                    from triton.backends.nvidia import driver as nvidia_driver

                    env[f"c{pos}"] = tuple(nvidia_driver.make_tensordesc_arg(value, raw[1][pos]))
                    exprs.append(f"*c{pos}")
                else:  # a constant tensor (kept alive by `constant`) by its address
                    env[f"c{pos}"] = value.data_ptr() if isinstance(value, torch.Tensor) else value
                    exprs.append(f"c{pos}")
                continue
            kind, slot, extra = by_pos[pos]
            if kind == _SLOT:
                exprs.append(f"s{slot}")
            elif kind == _PTR:
                exprs.append(f"s{slot} + {extra}")
            elif raw is not None:  # an encoded descriptor, by its base pointer
                offset, cls, fields = extra
                env[f"m{pos}"] = _TensorMaps(cls, fields, raw[1][pos])
                pre += [f"    p{pos} = s{slot} + {offset}", f"    e{pos} = m{pos}.get(p{pos}) or m{pos}.miss(p{pos})"]
                exprs.append(f"*e{pos}")
            else:  # a TMA descriptor for the wrapper: the recorded one with this call's base
                offset, cls, fields = extra
                env[f"cls{pos}"], env[f"f{pos}"] = cls, fields
                base = f"slots[{slot}]" if offset == 0 else f"_Ptr(slots[{slot}].data_ptr() + {offset})"
                pre += [f"    d{pos} = cls{pos}.__new__(cls{pos})", f"    d{pos}.__dict__.update(f{pos})",
                        f"    d{pos}.base = {base}"]
                exprs.append(f"d{pos}")
        g0, g1, g2 = grid
        if raw is None:
            call = [f"        run({g0}, {g1}, {g2}, stream, function, metadata, None, None, None, *args)"]
        else:
            env["raw"] = raw[0]
            env["coop"], env["pdl"] = run.launch_cooperative_grid, run.launch_pdl
            if raw[2] == "3.7":
                env["annotations"], env["signature"] = run.arg_annotations, run.kernel_signature
                call = [f"        raw({g0}, {g1}, {g2}, stream, function, coop, pdl, metadata, None, None, None, None,"
                        " None, annotations, signature, args)"]
            else:
                call = [f"        raw({g0}, {g1}, {g2}, stream, function, coop, pdl, None, None, metadata, None, None,"
                        " None, *args)"]
        src = "\n".join([
            "def call(slots, stream, hooks):", *pre,
            f"    args = ({', '.join(exprs)},)",
            "    if hooks is None:", *call,
            "    else:  # a profiler listens (Triton's proton): the launcher as the JIT calls it",
            "        replay_hooked(compiled, grid, slots, stream, hooks)",
        ])
        env["replay_hooked"] = self._hooked
        self._plain_args, self._subs = args, subs
        self.source = src  # for a reader (and the tests): what a replay runs
        exec(compile(src, f"<tileflash launch of {compiled.name}>", "exec"), env)
        self.call = env["call"]

    def _hooked(self, compiled, grid, slots, stream, hooks) -> None:
        args = list(self._plain_args)
        for pos, kind, slot, extra in self._subs:
            t = slots[slot]
            if kind == _SLOT:
                args[pos] = t
            elif kind == _PTR:
                args[pos] = t.data_ptr() + extra
            else:
                offset, cls, fields = extra
                desc = cls.__new__(cls)
                desc.__dict__.update(fields)
                desc.base = t if offset == 0 else _Ptr(t.data_ptr() + offset)
                args[pos] = desc
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *args), *hooks, *args)


class Recording:
    """The launches of one call, with its tensors identified by slot (see the module docstring)."""

    def __init__(self, slots):
        # One tensor passed for two arguments (k is v) is two slots: each gets an alias of its own, so that every
        # tensor argument names one slot even when a later call passes two tensors.
        seen = set()
        slots = list(slots)
        for i, t in enumerate(slots):
            if isinstance(t, torch.Tensor):
                if id(t) in seen:
                    slots[i] = t.as_strided(t.shape, t.stride(), t.storage_offset())
                seen.add(id(slots[i]))
        self.slots = tuple(slots)
        self.origin = {id(t): (i, 0) for i, t in enumerate(self.slots) if t is not None}
        self.keep = []  # derived objects stay alive while recording, so their ids stay unique
        self.constant_ids = set()
        self.launches = []
        self.refused = None

    def derive(self, obj, base) -> None:
        src = self.origin.get(id(base))
        if src is None and any(base is c for c in _constants):  # over a constant: a constant too
            self.keep.append(obj)
            self.constant_ids.add(id(obj))
            return
        if src is None:
            self.refused = f"a derived object's base is no slot ({type(base).__name__})"
            return
        slot, offset = src
        if isinstance(obj, torch.Tensor):
            self.origin[id(obj)] = (slot, offset + obj.data_ptr() - base.data_ptr())
        else:
            self.origin[id(obj)] = (slot, offset + obj.base.data_ptr() - base.data_ptr())
        self.keep.append(obj)

    def add(self, kernel, compiled, grid, args, kwargs) -> None:
        if compiled is None or self.refused:
            self.refused = self.refused or "a launch returned no compiled kernel"
            return
        names = kernel.arg_names
        values = list(args) + [kwargs[n] if n in kwargs else kernel.params[i].default
                               for i, n in enumerate(names) if i >= len(args)]
        subs = []
        for pos, value in enumerate(values):
            is_tensor = isinstance(value, torch.Tensor)
            if not (is_tensor or hasattr(value, "block_shape")):
                continue
            src = self.origin.get(id(value))
            if src is None:
                if id(value) in self.constant_ids or (is_tensor and any(value is c for c in _constants)):
                    continue
                self.refused = f"argument {names[pos]} of {kernel.fn.__name__} is a tensor that is no slot"
                return
            slot, offset = src
            if is_tensor:
                subs.append((pos, _SLOT, slot, 0) if offset == 0 else (pos, _PTR, slot, offset))
            else:
                # without its base: a plan must not keep the recording call's tensors (a whole KV cache) alive
                fields = {k: v for k, v in value.__dict__.items() if k != "base"}
                subs.append((pos, _DESC, slot, (offset, type(value), fields)))
            values[pos] = None
        grid = tuple(grid) + (1,) * (3 - len(grid))
        self.launches.append(_Launch(compiled, grid, values, tuple(subs)))


_constants: list = []


def constant(t: torch.Tensor) -> torch.Tensor:
    """Mark a tensor a replay may keep (a never-read stand-in such as the per-device dummy)."""
    _constants.append(t)
    return t


def derived(obj, base):
    """Register obj (a view of base, or a TMA descriptor whose base is base or a view of it) for the recording in
    progress; returns obj."""
    rec = getattr(_state, "recording", None)
    if rec is not None:
        rec.derive(obj, base)
    return obj


TRITON_DEFAULT_STAGES = 3  # a @triton.jit launch without num_stages


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs), recorded when a recording is in progress. A Triton kernel whose pipeline
    stages need more shared memory than the target has (tiles measured on the H200's 227 KB, compiled for a 99 KB
    consumer GPU) is launched with one stage fewer, down to one: stages change the speed, never the result."""
    while True:
        try:
            compiled = kernel[grid](*args, **kwargs)
            break
        except OutOfResources as exc:
            stages = kwargs.get("num_stages", TRITON_DEFAULT_STAGES)
            if "shared memory" not in str(exc) or stages <= 1:
                raise
            kwargs = {**kwargs, "num_stages": stages - 1}
    rec = getattr(_state, "recording", None)
    if rec is not None:
        rec.add(kernel, compiled, grid, args, kwargs)
    return compiled


class record:
    """`with record(slots) as rec: ...`: the launches inside, replayable by `replay(rec.launches, ...)` unless
    rec.refused says why not (a developer error, raised by tests)."""

    def __init__(self, slots):
        self.rec = Recording(slots)

    def __enter__(self) -> Recording:
        if getattr(_state, "recording", None) is not None:
            raise RuntimeError("tileflash: nested launch recordings")
        _state.recording = self.rec
        return self.rec

    def __exit__(self, *exc) -> None:
        _state.recording = None
        self.rec.keep.clear()


def replay(launches, slots, stream) -> None:
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    hooks = (enter, leave) if enter.calls or leave.calls else None
    for step in launches:
        step.call(slots, stream, hooks)


class Replayable:
    """A plan whose launches are recorded by its first execute and replayed by the later ones."""
    launches = None
    refused = None  # why the first execute's launches could not be recorded (tests require None)

    def execute(self, launch_fn, slots, stream) -> None:
        """launch_fn(*slots) launches the call's kernels through `launch`."""
        if self.launches is not None:
            replay(self.launches, slots, stream)
            return
        if not ENABLED:  # the interpreter, or direct launches switched off: plain launches every time
            launch_fn(*slots)
            return
        with record(slots) as rec:
            launch_fn(*rec.slots)
        if ENABLED and not rec.refused:
            self.launches = rec.launches
        self.refused = rec.refused


def current_stream(device: torch.device) -> int:
    """The raw handle of the current stream of a CUDA device (Triton launches on it); 0 elsewhere (the CPU
    compile check's stand-in driver)."""
    if device.type == "cuda":
        return torch._C._cuda_getCurrentRawStream(device.index)
    return 0


class Workspace:
    """fp32 scratch per (device, stream) for buffers that live within one call (split-KV partials, an lse nobody
    returns, the backward's row statistics). Calls on one stream are ordered, so they can share it. It only grows;
    an outgrown buffer is kept, since a captured CUDA graph may still point into it."""

    def __init__(self):
        self.buffers: dict = {}
        self.retired: list = []

    def get(self, device: torch.device, stream: int, numel: int) -> torch.Tensor:
        key = (device, stream)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            if buf is not None:
                self.retired.append(buf)
            buf = self.buffers[key] = self._new(device, max(numel, 2 * buf.numel() if buf is not None else 0,
                                                            1 << 16))
        return buf

    def _new(self, device, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.float32, device=device)


class Counters(Workspace):
    """int32 zeros per (device, stream) that every call leaves as it found them (the fused split merge's arrival
    counters; the one-launch backward's counters and fp32 dQ sums, +0.0 being zero bits), or None inside a
    CUDA-graph capture: captured calls take the combine launch (the backward: its three launches). A replayed graph pays
    no host time for the extra launch, and the merge by the last split of each tile cost GPU time (graph replay,
    b=1 ctx 8k: 14.6 us with the combine launch at 2492bb9, 24.2-25.2 once captures merged in the attention launch,
    run 210; run 97 measured the same), which eager calls hide behind their host time."""

    def get(self, device: torch.device, stream: int, numel: int) -> torch.Tensor | None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        return super().get(device, stream, numel)

    def _new(self, device, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.int32, device=device)


WORKSPACE = Workspace()
COUNTERS = Counters()


class PlanCache(dict):
    """signature -> plan of one op, emptied past MAX_PLANS entries; `clear_all()` empties every op's (after a
    monkeypatched heuristic, e.g. in a sweep). register=False: one held by a plan (the backward plans of a forward
    plan), emptied with it."""
    registry: list = []

    def __init__(self, register: bool = True):
        super().__init__()
        if register:
            PlanCache.registry.append(self)

    def put(self, key, plan):
        if len(self) >= MAX_PLANS:
            self.clear()
        self[key] = plan
        return plan


def plan_for(cache: PlanCache, key_fn, make):
    """The plan cached under key_fn() in cache, else make()'s (cached). A key that cannot be built or hashed
    (arguments of the wrong type) makes an uncached plan, whose checks then name the bad argument. Without direct
    launches (the interpreter) nothing is cached: every call plans anew."""
    if not ENABLED:
        return make()
    try:
        key = key_fn()
        plan = cache.get(key)
    except (TypeError, AttributeError):
        key = plan = None
    if plan is None:
        plan = make()
        if key is not None:
            cache.put(key, plan)
    return plan


def window_key(window_size):
    if type(window_size) is tuple:
        return window_size
    return tuple(window_size.tolist() if isinstance(window_size, torch.Tensor) else window_size)


def clear_all() -> None:
    for cache in PlanCache.registry:
        cache.clear()
