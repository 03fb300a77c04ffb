"""Write a drafter in a serving layout (sglang, hf, speculators, vllm) and read it back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_osprey.base.atomic_io import atomic_path, write_text_atomic
from megatron_osprey.base.hf_files import copy_tokenizer_files
from megatron_osprey.export import layouts
from megatron_osprey.export.config import ARCHITECTURE_NAMES, FORMATS  # noqa: E402,F401
from megatron_osprey.models.drafter.reference import CONFIG_NAME, WEIGHTS_NAME, ReferenceDrafter

# Used when the checkpoint does not say (a bare reference dir): Llama-3's context.
DEFAULT_MAX_POSITIONS = 131072


def detect_format(config: dict) -> str | None:
    """Which exported layout a config.json describes (None: not one of ours)."""
    archs = config.get("architectures") or []
    if (config.get("megatron_osprey") or {}).get("layout") == layouts.VLLM_LAYOUT:
        return "vllm"
    if layouts.SPECULATORS_ARCH in archs or config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if any(a in layouts.SGLANG_ARCHS for a in archs):
        return "sglang"
    return None


def _check_output(output: Path) -> None:
    """A free output directory: writers never delete (the export stage empties only its own earlier export). The
    stage's claim (its lock and writing marker, base/outputs.py) may already be there."""
    from megatron_osprey.base.outputs import WRITER_LOCK
    from megatron_osprey.base.provenance import WRITING_MARKER

    if output.exists() and not output.is_dir():
        raise FileExistsError(f"--output {output} is a file, not a directory.")
    if output.exists() and any(p.name not in (WRITER_LOCK, WRITING_MARKER) for p in output.iterdir()):
        raise FileExistsError(f"--output {output} exists and is not empty; pass --overwrite to replace it.")
    output.mkdir(parents=True, exist_ok=True)


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}  # no shared storage
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})


def _write_json(path: Path, payload: dict) -> None:
    text = json.dumps(payload, indent=2, sort_keys=False) + "\n"
    write_text_atomic(path, text)


def _max_positions(run_config: dict) -> int:
    body = (run_config.get("drafter") or {}).get("body_hf_config") or {}
    return int(body.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS)


def _target_config(run_config: dict) -> dict | None:
    """The run's target config.json, when its directory is still there."""
    target = run_config.get("target")
    if target and (Path(target) / "config.json").is_file():
        return json.loads((Path(target) / "config.json").read_text())
    return None


def _verifier(run_config: dict) -> dict:
    """Target name and architectures from the run's target directory, when it is still there."""
    target = run_config.get("target")
    info = {"name_or_path": str(target) if target else None, "architectures": []}
    if target and (Path(target) / "config.json").is_file():
        info["architectures"] = json.loads((Path(target) / "config.json").read_text()).get("architectures", [])
    return info


def export_drafter(
    drafter: ReferenceDrafter,
    fmt: str,
    output: Path,
    run_config: dict | None = None,
    tokenizer_dir: Path | None = None,
    architecture_names: str = "osprey",
) -> Path:
    """Write `drafter` to `output` in layout `fmt`; config.json is written last.

    architecture_names (sglang only): "osprey" (this project's plugin) or "release" (the names Osprey's
    release registers in its patched SGLang).
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {fmt!r}.")
    if architecture_names not in ARCHITECTURE_NAMES:
        raise ValueError(f"--architecture-names must be one of {ARCHITECTURE_NAMES}, got {architecture_names!r}.")
    if architecture_names != "osprey" and fmt != "sglang":
        raise ValueError(f"--architecture-names {architecture_names} names SGLang architectures; use --format sglang.")
    cfg, run_config = drafter.config, run_config or {}
    if fmt == "speculators" and layouts.speculators_refusal(cfg):
        raise ValueError(layouts.speculators_refusal(cfg))  # before touching --output
    if fmt == "vllm" and layouts.vllm_refusal(cfg, _target_config(run_config)):
        raise ValueError(layouts.vllm_refusal(cfg, _target_config(run_config)))
    output = Path(output)
    _check_output(output)
    state = {k: v for k, v in drafter.state_dict().items()}
    dtype = state["embed_tokens.weight"].dtype
    provenance = {"stage": run_config.get("stage"), "target": run_config.get("target")}
    if fmt == "hf":
        drafter.save_pretrained(output)
    elif fmt == "sglang":
        _save_tensors(output / WEIGHTS_NAME, layouts.sglang_state(state, cfg))
        config = layouts.sglang_config(cfg, dtype, _max_positions(run_config), provenance, architecture_names)
        _write_json(output / CONFIG_NAME, config)
    elif fmt == "vllm":
        _save_tensors(output / WEIGHTS_NAME, layouts.vllm_state(state, cfg))
        _write_json(output / CONFIG_NAME, layouts.vllm_config(cfg, dtype, _max_positions(run_config), provenance))
    else:
        _save_tensors(output / WEIGHTS_NAME, layouts.speculators_state(state, cfg))
        _write_json(
            output / CONFIG_NAME,
            layouts.speculators_config(cfg, dtype, _max_positions(run_config), _verifier(run_config), extra=provenance),
        )
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, output, keep_existing=True)
    return output


def read_export(directory: str | Path) -> ReferenceDrafter:
    """Load an sglang, speculators or vllm export back into a ReferenceDrafter (bit-exact inverse of export)."""
    from megatron_osprey.convert.safetensors_io import load_safetensors

    directory = Path(directory)
    config = json.loads((directory / CONFIG_NAME).read_text())
    fmt = detect_format(config)
    if fmt is None:
        raise ValueError(f"{directory / CONFIG_NAME} is not an SGLang, speculators or vLLM EAGLE-3 draft config.")
    cfg = layouts.drafter_config_from_export(config)
    tensors = load_safetensors(directory / WEIGHTS_NAME)
    if fmt == "sglang":
        state = layouts.reference_state_from_sglang(tensors, cfg)
    else:
        state = layouts.reference_state_from_vllm(tensors, cfg)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    drafter = ReferenceDrafter(cfg).to(state["embed_tokens.weight"].dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter
