"""What this machine can run, asked once in one place."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path


def have_transformer_engine() -> bool:
    """True when Transformer Engine's PyTorch extension imports (it needs CUDA to run).

    `import transformer_engine` alone is not the test: TE 2.x's top-level __init__ swallows the failure of its
    framework import, so it succeeds with a broken transformer_engine.pytorch, which Megatron-Core's TE spec needs.
    """
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_engine_usable() -> bool:
    """True when Transformer Engine is installed and CUDA is present."""
    import torch

    return torch.cuda.is_available() and have_transformer_engine()


# CUDA compute capability of each GPU type a recipe names (its `hardware`).
GPU_CAPABILITY = {"h100": (9, 0), "b200": (10, 0)}

# The compute capabilities each --fp8-recipe runs on, [lowest, first refused), as Transformer Engine 2.11 checks
# them when the autocast starts (check_fp8_support, check_mxfp8_support, check_fp8_block_scaling_support):
# per-tensor scaling (delayed, tensorwise) from Ada on; 1x128/128x128 block scaling from Hopper on (B200
# included) with CUDA 12.9 or newer; MXFP8 needs data-centre Blackwell (12.x workstation parts have no MXFP8 for
# every GEMM layout).
FP8_RECIPE_CAPABILITY = {
    "delayed": ((8, 9), None, "Ada, Hopper or Blackwell"),
    "tensorwise": ((8, 9), None, "Ada, Hopper or Blackwell"),
    "blockwise": ((9, 0), None, "Hopper or Blackwell"),
    "mxfp8": ((10, 0), (12, 0), "data-centre Blackwell (B200, B300)"),
}
# The CUDA version (torch.version.cuda) a recipe needs beyond its compute capability (TE 2.11's block scaling).
FP8_RECIPE_CUDA = {"blockwise": (12, 9)}


def fp8_recipe_runs(fp8_recipe: str, capability: tuple[int, int]) -> bool:
    """True when a GPU of compute `capability` has the GEMMs `fp8_recipe` needs."""
    low, high, _ = FP8_RECIPE_CAPABILITY[fp8_recipe]
    return capability >= low and (high is None or capability < high)


def fp8_recipe_refusal(
    fp8_recipe: str, capability: tuple[int, int], gpu: str, cuda_version: tuple[int, int] | None = None
) -> str | None:
    """Why `fp8_recipe` cannot run on `gpu` of compute `capability` under CUDA `cuda_version` (None: unknown, as
    when planning) — a sentence naming the flag — or None."""
    needs_cuda = FP8_RECIPE_CUDA.get(fp8_recipe)
    if fp8_recipe_runs(fp8_recipe, capability):
        if needs_cuda and cuda_version is not None and cuda_version < needs_cuda:
            return (
                f"--fp8-recipe {fp8_recipe} needs CUDA {_version(needs_cuda)} or newer (Transformer Engine's block "
                f"scaling GEMMs); this torch is built for CUDA {_version(cuda_version)}: use a newer container "
                f"or --fp8-recipe delayed."
            )
        return None
    low, high, needs = FP8_RECIPE_CAPABILITY[fp8_recipe]
    others = [name for name in FP8_RECIPE_CAPABILITY if name != fp8_recipe and fp8_recipe_runs(name, capability)]
    named = " or ".join([", ".join(others[:-1]), others[-1]] if len(others) > 1 else others)
    instead = f"use --fp8-recipe {named}" if others else "drop --fp8-format"
    span = f"{_version(low)} to below {_version(high)}" if high else f"{_version(low)} or higher"
    return (
        f"--fp8-recipe {fp8_recipe} needs {needs}, compute capability {span}; {gpu} is "
        f"{_version(capability)}: {instead}."
    )


def cuda_version() -> tuple[int, int] | None:
    """The CUDA version this torch is built for (torch.version.cuda), or None for a CPU build."""
    import torch

    version = torch.version.cuda
    return tuple(int(part) for part in version.split(".")[:2]) if version else None


def cuda_capability() -> tuple[int, int] | None:
    """This process's CUDA device's compute capability, or None without CUDA."""
    import torch

    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def _version(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


# Names a user (or a test) may force the CPU's capability to, instead of reading /proc/cpuinfo.
CPU_CAPABILITY_ENV = "OSPREY_CPU_CAPABILITY"
_FORCED = {
    "avx2": ("AVX2", ()),
    "avx512": ("AVX512", ()),
    "avx512_bf16": ("AVX512", ("avx512_bf16",)),
    "amx": ("AVX512", ("avx512_bf16", "amx_bf16")),
}
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclasses.dataclass(frozen=True)
class CpuCapability:
    """The vector ISA torch dispatches to on this CPU (torch.backends.cpu.get_cpu_capability's names) and its
    native bf16 instructions: without them a bf16 matmul is emulated, about 50x slower than float32."""

    isa: str  # "AVX512", "AVX2" or "older"
    bf16_flags: tuple[str, ...] = ()  # of avx512_bf16, amx_bf16
    source: str = "/proc/cpuinfo"

    @property
    def native_bf16(self) -> bool:
        return bool(self.bf16_flags)

    @property
    def compute_dtype(self) -> str:
        """What CPU training and generation compute in here: bf16 only where the CPU has it natively."""
        return "bfloat16" if self.native_bf16 else "float32"

    def line(self) -> str:
        """One line naming the capability (and float32 where it rules bf16 out), e.g. `CPU: AVX512 with bf16
        (avx512_bf16)` or `CPU: AVX2, no native bf16: float32 (...)`."""
        forced = f" (forced by {CPU_CAPABILITY_ENV})" if self.source == CPU_CAPABILITY_ENV else ""
        if self.native_bf16:
            return f"CPU: {self.isa} with bf16 ({', '.join(self.bf16_flags)}){forced}"
        return f"CPU: {self.isa}, no native bf16: float32 (bf16 would be emulated, tens of times slower){forced}"


def cpu_capability(environ: Mapping[str, str], cpuinfo: str | Path = "/proc/cpuinfo") -> CpuCapability:
    """This CPU's capability: forced by $OSPREY_CPU_CAPABILITY (avx2, avx512, avx512_bf16, amx) when `environ`,
    the entry point's environment, sets it; else read from the flags of `cpuinfo` (no file: no native bf16)."""
    forced = environ.get(CPU_CAPABILITY_ENV, "").strip().lower()
    if forced:
        if forced not in _FORCED:
            raise ValueError(f"{CPU_CAPABILITY_ENV}={forced!r} must be one of {', '.join(_FORCED)}.")
        isa, flags = _FORCED[forced]
        return CpuCapability(isa, flags, CPU_CAPABILITY_ENV)
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return CpuCapability("older", (), f"{cpuinfo} (unreadable)")
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    isa = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "older"
    return CpuCapability(isa, tuple(f for f in _BF16_FLAGS if f in flags), str(cpuinfo))
