"""`osprey submit` and `osprey pipeline`: render a recipe's stages as sbatch scripts and hand them to sbatch.

`osprey pipeline RECIPE --run-dir DIR` submits every stage of the recipe's chain as its own job, each with
`--dependency=afterok:` on the job whose output it reads, and prints one line per job: `STAGE JOBID`. All paths
derive from DIR (megatron_osprey/recipes/layout.py). A YAML recipe is copied into DIR first, and the jobs read
that copy, so a later edit of the user's file cannot change a chain in flight.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from launcher.plan import check_plan, make_plan
from launcher.render import SubmitOptions, render
from megatron_osprey.base.atomic_io import write_text_atomic
from megatron_osprey.recipes.layout import logs_dir
from megatron_osprey.recipes.recipe import STAGES, Recipe
from megatron_osprey.recipes.registry import is_recipe_file

# Which stages' outputs each stage reads (its jobs wait for those of them that the chain runs).
READS = {
    "prune": (),
    "preprocess": ("prune",),
    "pretrain": ("prune", "preprocess"),
    "adapt": ("pretrain", "prune"),
    "regenerate": (),
    "extract": ("regenerate",),
    "rollout": ("regenerate",),
    "distill": ("adapt", "regenerate", "extract", "rollout"),
    "export": ("distill",),
    "evaluate": ("distill", "export"),
}
_JOB_ID = re.compile(r"Submitted batch job (\d+)")


@dataclasses.dataclass
class Job:
    stage: str
    job_id: str | None  # None: a dry run
    script: Path | None


def _sbatch() -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise FileNotFoundError(
            "sbatch is not on PATH; run on a Slurm login node (or `osprey cluster up` for a one-machine cluster), "
            "or pass --dry-run to see the scripts."
        )
    return sbatch


def submit_script(script: str, path: Path, dependencies: list[str], env: dict | None = None) -> str:
    """Write `script` to `path` and sbatch it (after `dependencies` succeed); returns the job id."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, script)
    os.chmod(path, 0o755)
    argv = [_sbatch()]
    if dependencies:
        argv.append(f"--dependency=afterok:{':'.join(dependencies)}")
    done = subprocess.run(argv + [str(path)], capture_output=True, text=True, check=False, env=env)
    match = _JOB_ID.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"sbatch {path} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
    return match.group(1)


def chain_stages(recipe: Recipe, start: str | None = None, until: str | None = None) -> list[str]:
    """The recipe's chain from `start` through `until` (names checked against the chain)."""
    chain = list(recipe.chain)
    for flag, stage in (("--from", start), ("--until", until)):
        if stage is not None and stage not in chain:
            raise ValueError(f"{flag} {stage}: recipe {recipe.name} runs {', '.join(chain)}.")
    first = chain.index(start) if start else 0
    last = chain.index(until) if until else len(chain) - 1
    if first > last:
        raise ValueError(f"--from {start} comes after --until {until} in {', '.join(chain)}.")
    return chain[first : last + 1]


def pipeline(
    recipe: Recipe,
    spec: str,
    run_dir: str | Path,
    overrides: list[str] | None = None,
    options: SubmitOptions | None = None,
    *,
    start: str | None = None,
    until: str | None = None,
    dry_run: bool = False,
    env: dict | None = None,
    say=print,
) -> list[Job]:
    """Submit the chain (or its --from/--until part) as dependent jobs; returns them in order."""
    run_dir = Path(run_dir).absolute()
    stages = chain_stages(recipe, start, until)
    for stage in stages:  # refuse a layout that cannot run before anything is submitted
        if stage in ("pretrain", "distill", "extract"):
            check_plan(make_plan(recipe, stage, str(run_dir)))
    if is_recipe_file(spec) and not dry_run:
        copy = run_dir / "recipe.yaml"
        run_dir.mkdir(parents=True, exist_ok=True)
        if Path(spec).resolve() != copy.resolve():
            shutil.copyfile(spec, copy)
        spec = str(copy)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    jobs: dict[str, Job] = {}
    for stage in stages:
        script = render(recipe, spec, stage, str(run_dir), overrides, options)
        if dry_run:
            say(f"# --- {stage} ---")
            say(script)
            jobs[stage] = Job(stage, None, None)
            continue
        Path(logs_dir(run_dir)).mkdir(parents=True, exist_ok=True)
        waits = [jobs[s].job_id for s in READS[stage] if s in jobs]
        path = Path(logs_dir(run_dir)) / "sbatch" / f"{stage}-{stamp}.sbatch"
        job_id = submit_script(script, path, waits, env)
        jobs[stage] = Job(stage, job_id, path)
        say(f"{stage} {job_id}")
    return list(jobs.values())


def submit(
    recipe: Recipe,
    spec: str,
    stage: str,
    run_dir: str | Path,
    overrides: list[str] | None = None,
    options: SubmitOptions | None = None,
    *,
    dry_run: bool = False,
    say=print,
) -> Job:
    """One stage as one job (`osprey submit`): the pipeline restricted to that stage."""
    if stage not in STAGES:
        raise ValueError(f"--stage {stage!r} is not one of {', '.join(STAGES)}.")
    jobs = pipeline(recipe, spec, run_dir, overrides, options, start=stage, until=stage, dry_run=dry_run, say=say)
    return jobs[0]
