"""What this machine can run, asked once in one place."""

from __future__ import annotations


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
