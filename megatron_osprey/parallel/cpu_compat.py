"""Megatron-Core on a machine without CUDA: the CUDA-only call sites, handled.

Megatron-Core (0.16.1 to 0.19.x) assumes a GPU in these places (measured with torch 2.13
and 2.14 on CPU, gloo, tiny models at TP/PP/EP=2):

1. `torch.cuda.current_device()` picks the device of new tensors (utils, rotary
   embeddings, p2p communication, grad buffers, TP layers and mappings, the MoE
   router, the distributed optimizer, checkpoint saving);
2. `torch.cuda.synchronize()` runs on every checkpoint save and in p2p communication;
3. `torch.cuda.get_rng_state` / `manual_seed` back the tensor-parallel RNG tracker:
   without them nothing crashes but every tracker stream is identical, so TP ranks
   share dropout streams; and `_set_cuda_rng_state` is a silent no-op on CPU builds,
   so `fork()` never switches streams;
4. tensors created with a hard-coded `device="cuda"`, `.cuda()` calls (tied
   embeddings under PP), and `Tensor.type()` checks against `torch.cuda.*Tensor`
   names in the optimizer;
5. torch norms assert `not sequence_parallel`, though their weights still need the
   sequence-parallel tag so their grads are all-reduced across TP;
6. MoE: `te_general_gemm` is undefined without Transformer Engine, split sizes stay
   tensors on the CPU (gloo's all_to_all_single rejects them), and the all-to-all
   dispatcher copies them to the host on a `torch.cuda.Stream`;
7. from 0.17 on, the grad buffers wait on `torch.cuda.current_stream()` before each
   grad reduction.

Without CUDA these places either crash or, worse, run silently wrong (item 3).
`activate()` patches them so that the real Megatron-Core modules run under gloo on
the CPU; it refuses to do anything when CUDA is present. It accepts the megatron-core
releases pyproject.toml's range allows (each end tested: launcher/locks/cpu.txt and
cpu-newest.txt) and refuses any other in one line; within the range it branches on what a
module holds, never on the version number, and `check_call_sites()` is the canary that
fails loudly when a release moves a call site.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import types
from typing import Any, Callable

import torch

# The range pyproject.toml declares: the lowest release tested and the first one that is not.
SUPPORTED_MEGATRON_CORE = (">=0.16.1", "<0.20")

# Marker set on the patched torch.cuda functions: the patch state lives on the
# patched objects themselves, so this module keeps no state of its own.
_MARK = "__osprey_cpu_compat__"

# Modules that create tensors with a hard-coded device="cuda"; they get a torch
# proxy that places such tensors on the CPU (and makes their CUDA streams no-ops).
# Each entry names a source snippet that must still be present (the canary); the
# tables hold only call sites that every release of the supported range has, and a
# call site one release adds is handled by what its module's stand-in already does.
HARDCODED_CUDA_MODULES: dict[str, str] = {
    "megatron.core.pipeline_parallel.schedules": 'device="cuda"',
    "megatron.core.optimizer.clip_grads": "device='cuda'",
    "megatron.core.optimizer.optimizer": "device='cuda'",
    "megatron.core.utils": 'device="cuda"',
    "megatron.core.transformer.utils": 'device="cuda"',
    "megatron.core.tensor_parallel.data": "device='cuda'",
    "megatron.core.distributed.param_and_grad_buffer": 'device="cuda"',
}

# Call sites reached through torch.cuda.* that the torch.cuda patches cover.
TORCH_CUDA_CALL_SITES: dict[str, str] = {
    "megatron.core.tensor_parallel.random": "torch.cuda.manual_seed(",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "torch.cuda.current_device()",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "torch.cuda.synchronize()",
    "megatron.core.models.common.language_module.language_module": ".cuda()",
}

# Megatron-Core's optimizer checks `param.type()` against CUDA tensor type names.
_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
TENSOR_TYPE_MODULES: dict[str, str] = {
    "megatron.core.optimizer.optimizer": "param.type() == 'torch.cuda.FloatTensor'",
    "megatron.core.optimizer.distrib_optimizer": "model_param.type() == 'torch.cuda.FloatTensor'",
}

_FACTORY_FUNCTIONS = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn")

# Mixture-of-experts call sites (item 6 of the module docstring), each patched by `_patch_moe`:
# - moe_utils imports te_general_gemm only inside its TE try-block, so without TE
#   the router's `te_general_gemm is not None` test raises NameError: bind it to None.
# - maybe_move_tensor_to_cpu converts split sizes only when they are CUDA tensors;
#   on the CPU they stay tensors, which gloo's all_to_all_single rejects as split
#   sizes: convert CPU tensors the same way (to numpy when asked).
# - the alltoall dispatcher moves split sizes to the host on a torch.cuda.Stream
#   and waits on its Event: on the CPU a no-op stream and event do the same job.
MOE_CALL_SITES: dict[str, str] = {
    "megatron.core.transformer.moe.moe_utils": "if te_general_gemm is not None and router_dtype != torch.float64:",
    "megatron.core.transformer.moe.moe_utils ": "if torch.is_tensor(tensor) and tensor.is_cuda:",
    "megatron.core.transformer.moe.token_dispatcher": (
        "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()"
    ),
    "megatron.core.transformer.moe.token_dispatcher ": "with torch.cuda.stream(self.cuda_dtoh_stream):",
    "megatron.core.transformer.moe.token_dispatcher  ": "self.d2h_event = self.cuda_dtoh_stream.record_event()",
}


def cuda_available() -> bool:
    """True when a usable CUDA device exists (then the layer stays off)."""
    return torch.cuda.is_available()


def is_active() -> bool:
    """True when the compatibility patches are installed in this process."""
    return bool(getattr(torch.cuda.current_device, _MARK, False))


def _cpu_device(device: Any) -> Any:
    if device is None:
        return device
    text = str(device)
    if text == "cuda" or text.startswith("cuda:"):
        return torch.device("cpu")
    return device


class _TorchOnCpu(types.ModuleType):
    """A stand-in for `torch` inside one module: tensor factories asked for CUDA get the CPU, and its `torch.cuda`
    streams and events are CPU no-ops (megatron-core 0.17+ has the grad buffers wait on the current stream)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaStreamsOnCpu()

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in _FACTORY_FUNCTIONS:
            return _wrap_factory(value)
        return value


def _wrap_factory(fn: Callable) -> Callable:
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return factory


def _cuda_type_name(original: Callable) -> Callable:
    def type_name(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        return _CPU_TO_CUDA_TYPE.get(name, name)

    return type_name


@dataclasses.dataclass
class CompatHandle:
    """What `activate()` changed, so that `deactivate()` can put it back."""

    torch_cuda: dict[str, Any]
    torch_cuda_random: dict[str, Any]
    tensor_methods: dict[str, Any]
    module_attrs: list[tuple[types.ModuleType, str, Any]]
    log_filter: logging.Filter | None = None


class _SameStreamWarningFilter(logging.Filter):
    # On the CPU the tracker's streams *are* the CPU generator, so Megatron's
    # "CPU RNG state changed within GPU RNG context" warning is expected there.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def supported(version: str) -> bool:
    """True when `version` (a local label such as +gitsha is ignored) lies in SUPPORTED_MEGATRON_CORE."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(version).public in SpecifierSet(",".join(SUPPORTED_MEGATRON_CORE), prereleases=True)


def check_megatron_version() -> str:
    """Return the installed megatron-core version; raise if it lies outside the supported range."""
    from megatron.core import package_info

    version = package_info.__version__
    if not supported(version):
        wanted = ",".join(SUPPORTED_MEGATRON_CORE)
        raise RuntimeError(
            f"megatron_osprey's CPU compatibility layer supports megatron-core{wanted} but {version} is "
            f"installed; install a release in that range (pip install 'megatron-core{wanted}')."
        )
    return version


def check_call_sites() -> None:
    """Canary: every patched Megatron-Core call site still looks as it did when measured."""
    check_megatron_version()
    tables = (HARDCODED_CUDA_MODULES, TORCH_CUDA_CALL_SITES, TENSOR_TYPE_MODULES, MOE_CALL_SITES)
    for table in tables:
        for module_key, snippet in table.items():
            # Trailing spaces let one module appear several times in a table (one key per snippet).
            module_name = module_key.strip()
            source = inspect.getsource(importlib.import_module(module_name))
            if snippet not in source:
                raise RuntimeError(
                    f"megatron-core call site moved: {module_name} no longer contains "
                    f"{snippet!r}; update megatron_osprey/parallel/cpu_compat.py."
                )


def activate() -> CompatHandle | None:
    """Install the CPU patches when CUDA is absent; returns None (and changes nothing) otherwise."""
    if cuda_available() or is_active():
        return None
    check_call_sites()
    from megatron.core.tensor_parallel import random as mcore_random

    handle = CompatHandle({}, {}, {}, [])

    def current_device() -> torch.device:
        return torch.device("cpu")

    def synchronize(device: Any = None) -> None:
        return None

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    setattr(current_device, _MARK, True)
    cuda_patches = {
        "current_device": current_device,
        "synchronize": synchronize,
        "get_rng_state": get_rng_state,
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed,
    }
    for name, fn in cuda_patches.items():
        handle.torch_cuda[name] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, fn)
    for name in ("get_rng_state", "manual_seed", "manual_seed_all"):
        handle.torch_cuda_random[name] = getattr(torch.cuda.random, name)
        setattr(torch.cuda.random, name, cuda_patches[name])

    # `.cuda()` means "the current device": here that is the CPU.
    handle.tensor_methods["cuda"] = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    # The optimizer accepts only parameters whose `type()` names a CUDA tensor.
    handle.tensor_methods["type"] = torch.Tensor.type
    torch.Tensor.type = _cuda_type_name(torch.Tensor.type)  # type: ignore[method-assign]

    def patch_module_attr(module: types.ModuleType, name: str, value: Any) -> None:
        handle.module_attrs.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    # Without this the tracker never switches streams on CPU builds (a silent no-op).
    patch_module_attr(mcore_random, "_set_cuda_rng_state", set_rng_state)
    patch_module_attr(mcore_random, "_get_cuda_rng_state", get_cuda_rng_state)
    for module_name in HARDCODED_CUDA_MODULES:
        patch_module_attr(importlib.import_module(module_name), "torch", _TorchOnCpu())
    _patch_torch_norm_sequence_parallel(patch_module_attr)
    _patch_moe(patch_module_attr)

    handle.log_filter = _SameStreamWarningFilter()
    logging.getLogger(mcore_random.__name__).addFilter(handle.log_filter)
    return handle


def _patch_torch_norm_sequence_parallel(patch_module_attr: Callable) -> None:
    """Torch norms refuse sequence parallel; allow it and tag the weights for the TP all-reduce."""
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, persist_layer_norm, **kwargs)
        sp_off = dataclasses.replace(config, sequence_parallel=False)
        norm = original(cls, sp_off, hidden_size, eps, persist_layer_norm, **kwargs)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", True)
        return norm

    patch_module_attr(torch_norm.WrappedTorchNorm, "__new__", staticmethod(new))


class _CpuEvent:
    """Stands in for a torch.cuda.Event: CPU work is already complete when recorded."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None


class _CpuStream:
    """Stands in for a torch.cuda.Stream: the CPU has one in-order stream."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        return None


class _CudaStreamsOnCpu(types.ModuleType):
    """A stand-in for `torch.cuda` inside one module: streams and events that do nothing."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        if name in ("Stream", "Event"):
            return _CpuStream if name == "Stream" else _CpuEvent
        if name in ("current_stream", "default_stream"):
            return lambda device=None: _CURRENT_STREAM
        if name == "stream":
            return lambda stream=None: contextlib.nullcontext()
        return getattr(torch.cuda, name)


# Immutable: the one CPU stream every current_stream() call returns, so that
# `current_stream() != side_stream` is True as it is on a GPU.
_CURRENT_STREAM = _CpuStream()


class _TorchWithCpuStreams(types.ModuleType):
    """A stand-in for `torch` inside one module whose `torch.cuda` streams are CPU no-ops."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaStreamsOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _split_sizes_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """maybe_move_tensor_to_cpu for CPU tensors too: split sizes must leave tensor form for gloo."""
    if torch.is_tensor(tensor):
        tensor = tensor.detach().cpu()
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _patch_moe(patch_module_attr: Callable) -> None:
    """The MoE router, split sizes and dispatcher streams on the CPU (see MOE_CALL_SITES)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        # patch_module_attr records the current value; bind a placeholder first so
        # that deactivate() puts back exactly "absent" semantics via None.
        moe_utils.te_general_gemm = None
    patch_module_attr(moe_utils, "te_general_gemm", None)
    patch_module_attr(moe_utils, "maybe_move_tensor_to_cpu", _split_sizes_to_host)
    patch_module_attr(token_dispatcher, "maybe_move_tensor_to_cpu", _split_sizes_to_host)
    patch_module_attr(token_dispatcher, "torch", _TorchWithCpuStreams())
    # The dispatcher caches its side stream on the class: reset it so no CPU stand-in outlives activate().
    patch_module_attr(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", None)


def deactivate(handle: CompatHandle | None) -> None:
    """Undo `activate()`; a None handle (nothing was patched) is a no-op."""
    if handle is None:
        return
    for name, fn in handle.torch_cuda.items():
        setattr(torch.cuda, name, fn)
    for name, fn in handle.torch_cuda_random.items():
        setattr(torch.cuda.random, name, fn)
    for name, fn in handle.tensor_methods.items():
        setattr(torch.Tensor, name, fn)
    for module, name, value in reversed(handle.module_attrs):
        setattr(module, name, value)
    if handle.log_filter is not None:
        from megatron.core.tensor_parallel import random as mcore_random

        logging.getLogger(mcore_random.__name__).removeFilter(handle.log_filter)
