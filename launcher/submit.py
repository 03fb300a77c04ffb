"""`osprey submit`: render a recipe's sbatch script, write it beside the logs, and hand it to sbatch."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from launcher.commands import work_dir
from launcher.render import SubmitOptions, render
from megatron_osprey.base.atomic_io import write_text_atomic
from megatron_osprey.config.recipes.recipe import Recipe


def script_path(recipe: Recipe, stage: str) -> Path:
    """Where the rendered script is kept: <paths.logs>/sbatch/<job>-<time>.sbatch (relative: under work_dir())."""
    logs = Path(recipe.resolved_paths()["logs"])
    logs = logs if logs.is_absolute() else work_dir() / logs
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return logs / "sbatch" / f"osprey-{stage}-{recipe.run_name}-{stamp}.sbatch"


def submit(
    recipe: Recipe,
    stage: str,
    options: SubmitOptions | None = None,
    extra: list[str] | None = None,
    *,
    dry_run: bool = False,
    say=print,
) -> int:
    """Print the script (dry run) or write it and run `sbatch` on it; returns sbatch's exit code."""
    script = render(recipe, stage, options, extra)
    if dry_run:
        say(script)
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise FileNotFoundError("sbatch is not on PATH; run on a Slurm login node, or use --dry-run to see the script.")
    path = script_path(recipe, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    (work_dir() / recipe.resolved_paths()["logs"]).mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, script)
    os.chmod(path, 0o755)
    say(f"osprey: wrote {path}")
    say(f"osprey: sbatch {path}")
    # From the work directory, so the relative recipe paths in #SBATCH --output resolve as in the job.
    return subprocess.run([sbatch, str(path)], cwd=work_dir(), check=False).returncode
