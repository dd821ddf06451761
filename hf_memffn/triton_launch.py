"""Launching a Triton kernel with less host time per call.

``kernel[grid](*args)`` binds and specialises every argument on each call before it reaches the compiled kernel
(Triton's generated binder, its cache key, the check of the globals the kernel reads): some tens of microseconds
of host time per launch on a busy host, where a whole aten operation takes about ten. An eager decoding step
launches a few of our kernels per layer (the norms, the rotary embedding, the FFN's kernel), and the step is bound
by the host, so that time is a share of the step.

:func:`launch` launches through Triton the first time it sees an argument signature, keeps the compiled kernel that
Triton returns, and launches it directly (``compiled[grid](*arguments)``, in Triton 3.6 to 3.9) for later calls of
the same signature. The signature is finer than Triton's specialisation, so a kernel compiled for other arguments is
never reused: for each tensor its dtype and whether its address is a multiple of 16 bytes (Triton's alignment rule
for pointers); for each tensor descriptor (the Gluon kernels' arguments) its base's dtype and alignment and every
other field (shape, strides, block shape, shared layout, padding); for every other argument its exact value (Triton
specialises integers on being 1 or a multiple of 16, and constexprs on their value), except the integers of a build
that leaves them unspecialised (`any_size`), whose value only sets their type (32-bit, 64-bit or unsigned 64-bit,
as Triton types them); and the keyword arguments (constexprs and launch options such as ``num_warps``) with their
values, on the current device. The direct launch skips what Triton does before the compiled kernel on every call:
the binder, the check that the kernel's globals have not changed since it was compiled, and the kernel's pre-run
hooks (none of ours has either). Under ``TRITON_INTERPRET=1`` and while ``torch.compile`` traces, every launch goes
through Triton (interpreted launches one thread at a time). ``CACHED = False`` sends every launch through Triton
(the benchmarks compare both). Every launch runs on the CUDA device of its first tensor, made current for the call
where another device is (a model split over GPUs with ``device_map``).

The module also holds the torch helpers that the kernels' files and the modules around them share (an operator's
registration, autocast switched off around a computation documented as float32): every checkpoint carries it, and it
imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

CACHED = True  # False: every launch through `kernel[grid](...)`
# How every kernel of this package is compiled, passed with its first launch: with floating-point fusion (a * b + c
# as one FMA), the default of Triton 3.6 to 3.9 under which the kernels were checked and timed. Asked for explicitly
# because Triton 3.9 warns that 3.10 turns it off by default.
COMPILE_OPTIONS = {"enable_fp_fusion": True}
MAX_SIGNATURES = 4096  # compiled kernels kept; past this, the cache starts again (each new signature costs one
# launch through Triton, which finds the compiled kernel in its own cache)

# Triton reads TRITON_INTERPRET when it is first imported: kernels then run in its interpreter, on CPU tensors (the
# kernel modules record this with their triton import)
INTERPRET_REQUESTED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Triton's interpreter keeps the running kernel's grid and its patched `triton.language` in process-wide state: two
# threads interpreting kernels at once (a model's forward called from several threads) fail or read each other's
# grid, so interpreted launches run one at a time
_INTERPRETER_LOCK = threading.Lock()
_compiled: dict = {}


_unspecialised: dict = {}  # kernel -> positions of the parameters it leaves unspecialised (`any_size`)


def _integer_type(value: int) -> str:
    """The type Triton gives an integer argument that it does not specialise (Triton 3.6 to 3.9)."""
    return "i32" if -2**31 <= value < 2**31 else "u64" if value >= 2**63 else "i64"


_PLAIN = frozenset({int, float, bool, type(None)})


def _argument_key(arg, unspecialised: bool = False):
    """What a launch's compiled kernel may depend on, of an argument that is not a tensor."""
    if unspecialised and type(arg) is int:
        return int, _integer_type(arg)
    if type(arg) in _PLAIN:
        return type(arg), arg
    key = getattr(arg, "launch_key", None)  # a tensor descriptor that says what it was built from
    if key is not None:
        return key
    if hasattr(arg, "block_shape") and hasattr(arg, "base"):  # any other tensor descriptor: all its fields
        return (type(arg), arg.base.dtype, arg.base.data_ptr() % 16 == 0,
                *((name, tuple(value) if isinstance(value, list) else value)
                  for name, value in vars(arg).items() if name != "base"))
    return type(arg), arg


def _signature(kernel, args: tuple) -> tuple:
    positions = _unspecialised.get(kernel)
    if positions is None:
        positions = _unspecialised[kernel] = frozenset(
            param.num for param in getattr(kernel, "params", ()) if getattr(param, "do_not_specialize", False))
    tensor, plain = torch.Tensor, _PLAIN
    if not positions:  # (the common case, kept to one pass without an index)
        return tuple([(arg.dtype, arg.data_ptr() % 16 == 0) if isinstance(arg, tensor)
                      else (type(arg), arg) if type(arg) in plain else _argument_key(arg) for arg in args])
    return tuple([(arg.dtype, arg.data_ptr() % 16 == 0) if isinstance(arg, tensor)
                  else _argument_key(arg, index in positions) for index, arg in enumerate(args)])


def _device_index(args: tuple) -> int:
    """The CUDA device of a launch's first tensor (or tensor descriptor's base) argument, -1 for a host tensor."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.get_device()
        base = getattr(arg, "base", None)
        if isinstance(base, torch.Tensor):
            return base.get_device()
    raise TypeError("launch: no tensor among the arguments to say which CUDA device runs the kernel")


def _through_triton(kernel, grid, args: tuple, kwargs: dict):
    """Triton's own launch, with `COMPILE_OPTIONS` after the caller's options unless the caller names them."""
    options = {name: value for name, value in COMPILE_OPTIONS.items() if name not in kwargs}
    return kernel[grid](*args, **kwargs, **options)


def launch(kernel, grid: tuple, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` for a ``triton.jit`` (or Gluon) function whose arguments are tensors, tensor
    descriptors, numbers, booleans or None; returns the compiled kernel (None where Triton returns none, as under
    its interpreter). The parameters that ``args`` leaves out must all come as keyword arguments (defaults are not
    filled in); keyword arguments that are not parameters are launch options (`COMPILE_OPTIONS` is added to them
    where they do not name it: a caller that names it sets where it stands among them, which is part of Triton's
    in-memory cache key)."""
    if INTERPRET_REQUESTED:
        with _INTERPRETER_LOCK:
            return _through_triton(kernel, grid, args, kwargs)
    # Triton launches on the current device (and its current stream); a model split over GPUs (`device_map`) calls
    # a layer on cuda:1 while cuda:0 is current, so the launch moves to the device of the tensors it reads
    device = _device_index(args)
    if device >= 0 and device != torch.cuda.current_device():  # (-1: a host tensor, which Triton refuses itself)
        with torch.cuda.device(device):
            return launch(kernel, grid, *args, **kwargs)
    if not CACHED or torch.compiler.is_compiling():
        return _through_triton(kernel, grid, args, kwargs)
    # (the kernel by its id: a Triton function hashes in Python, about a microsecond per launch; the kept entry holds
    # the kernel, so its id is not reused while the entry exists)
    key = (id(kernel), device if device >= 0 else torch.cuda.current_device(), tuple(kwargs.items()),
           _signature(kernel, args))  # (a tensor's device is the current one here)
    kept = _compiled.get(key)
    if kept is None:
        names = kernel.arg_names
        missing = [name for name in names[len(args):] if name not in kwargs]
        if missing:
            raise TypeError(f"launch({kernel.__name__}): parameters {missing} must be given (defaults are not "
                            "filled in by the direct launch)")
        compiled = _through_triton(kernel, grid, args, kwargs)
        if compiled is not None:
            if len(_compiled) >= MAX_SIGNATURES:
                _compiled.clear()
            _compiled[key] = (compiled, names[len(args):], kernel)
        return compiled
    compiled, keyword_names, _ = kept
    grid = (*grid, 1, 1)[:3] if len(grid) < 3 else grid
    compiled[grid](*args, *[kwargs[name] for name in keyword_names])
    return compiled


def cdiv(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for launch grids. Triton's ``triton.cdiv`` (and ``next_power_of_2``) are
    functions that kernels can also call, whose Python call unwraps its arguments first: a few microseconds per call,
    several per launch."""
    return -(-numerator // denominator)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def any_size(kernel, *arguments: str):
    """``kernel`` built a second time for inference, with ``arguments`` (those that follow the number of tokens in a
    call) left unspecialised (Triton's ``do_not_specialize``).

    Triton compiles a kernel again for each new combination of its integer arguments being 1, a multiple of 16, or
    neither. A training run's shapes are fixed, and knowing a size is a multiple of 16 saves a few instructions per
    tile (one predicate for four rows of a mask), so training launches the kernel as it is. Inference sees a new
    number of tokens at every decoding step, prompt and continuous-batching step: launched with this build, a kernel
    is compiled once, whatever the sizes, instead of a second time in the middle of serving (about a second for the
    Gluon forward). Arguments that bound a mask along a tensor's contiguous dimension, and strides, stay specialised
    (a multiple of 16 lets the masked loads vectorise); kernels that only inference runs take ``do_not_specialize``
    directly."""
    import inspect

    parameters = list(inspect.signature(kernel.fn).parameters)
    unknown = [name for name in arguments if name not in parameters]
    if unknown:  # Triton would ignore them: the build would specialise them after all
        raise ValueError(f"any_size({kernel.fn.__name__}): {unknown} are not among its parameters {parameters}")
    return type(kernel)(kernel.fn, do_not_specialize=list(arguments))


# The dtypes of the tensors this package's element-wise kernels (norm, rotation, KV-FFN activation, table add) take:
# they compute in float32 and round once per output, so a float64 tensor would come back as float64 holding float32's
# precision
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def refuse_kernel_dtype(function: str, name: str, dtype: torch.dtype) -> None:
    """Raises for the argument ``name`` of the kernels' ``function``, of a ``dtype`` outside ``KERNEL_DTYPES`` (the
    callers test membership themselves: they run once per layer and step, where a call costs host time)."""
    raise ValueError(f"{function}: {name} has dtype {dtype}, which the Triton kernels do not take (they compute in "
                     "float32); allowed: float16, bfloat16, float32. The PyTorch operations (the model's kernel "
                     "setting 'torch', or 'auto') keep float64's precision")


def registered_operator(namespace: str, name: str):
    """The operator ``namespace::name`` if this process has registered it, else None. Each file that registers
    operators does so once per process, whichever copy of it is imported first: a checkpoint's remote code brings
    another copy, under another module name."""
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


def autocast_available(device_type: str) -> bool:
    """Whether ``device_type`` has autocast: not the meta device, on which a model runs to get its shapes and where
    ``torch.autocast`` raises. Under torch.compile it is taken as available without asking (torch 2.11's dynamo cannot
    trace ``torch.amp.is_autocast_available`` and breaks the graph there; compiled code runs on real devices)."""
    return torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type)


def autocast_off(device_type: str):
    """``torch.autocast(device_type, enabled=False)``, or no context on a device without autocast."""
    if autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``: never on a device without autocast (the meta device)."""
    return autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def clear() -> None:
    """Forgets the compiled kernels kept (the next launch of each signature goes through Triton)."""
    _compiled.clear()
    _unspecialised.clear()


__all__ = ["launch", "any_size", "clear", "cdiv", "next_power_of_2", "registered_operator", "CACHED", "KERNEL_DTYPES",
           "refuse_kernel_dtype", "autocast_available", "autocast_off", "autocast_enabled"]
