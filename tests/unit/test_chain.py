"""A chain of stages: which stages `osprey pipeline` submits, which job waits on which, and the provenance check
that refuses an input changed since the stage that wrote it recorded it. No Slurm: sbatch is a stand-in that
records its command line and answers with a job id."""

from __future__ import annotations

import json
import subprocess

import pytest

from launcher import submit
from megatron_osprey.base.provenance import ProvenanceError, check_input, digest, write_provenance
from megatron_osprey.recipes import get_recipe

DISTILL = "qwen3_8b_osprey_distill_2gpu_h100_bf16"  # adapt, regenerate, distill, export, evaluate
BACKBONE = "tiny_cpu_backbone_pretrain_2proc_fp32"  # prune, preprocess, pretrain


@pytest.fixture
def sbatch(monkeypatch):
    """Each sbatch call as (script name, its --dependency value or None); job ids count up from 101."""
    calls = []

    def run(argv, **kwargs):
        dependency = [a.removeprefix("--dependency=") for a in argv if a.startswith("--dependency=")]
        calls.append((argv[-1].rsplit("/", 1)[-1].split("-")[0], dependency[0] if dependency else None))
        return subprocess.CompletedProcess(argv, 0, stdout=f"Submitted batch job {100 + len(calls)}\n", stderr="")

    monkeypatch.setattr(submit, "_sbatch", lambda: "sbatch")
    monkeypatch.setattr(submit.subprocess, "run", run)
    return calls


def _waits(jobs, calls) -> dict[str, list[str]]:
    """stage -> the stages whose jobs it waits on, read back from the job ids in its --dependency."""
    stage_of = {job.job_id: job.stage for job in jobs}
    return {
        stage: [stage_of[i] for i in dependency.removeprefix("afterok:").split(":")] if dependency else []
        for stage, dependency in calls
    }


def _pipeline(name, tmp_path, **kwargs):
    return submit.pipeline(get_recipe(name), name, tmp_path / "run", say=lambda line: None, **kwargs)


def test_each_job_waits_on_the_jobs_of_the_stages_it_reads(sbatch, tmp_path):
    jobs = _pipeline(DISTILL, tmp_path)
    assert [(j.stage, j.job_id) for j in jobs] == [
        ("adapt", "101"),
        ("regenerate", "102"),
        ("distill", "103"),
        ("export", "104"),
        ("evaluate", "105"),
    ]
    assert _waits(jobs, sbatch) == {
        "adapt": [],
        "regenerate": [],
        "distill": ["adapt", "regenerate"],
        "export": ["distill"],
        "evaluate": ["distill", "export"],
    }
    assert all(job.script.is_file() and job.script.parent.name == "sbatch" for job in jobs)
    jobs = _pipeline(BACKBONE, tmp_path / "backbone")
    assert _waits(jobs, sbatch[5:]) == {"prune": [], "preprocess": ["prune"], "pretrain": ["prune", "preprocess"]}


def test_from_and_until_submit_a_part_of_the_chain_waiting_only_on_what_it_submits(sbatch, tmp_path):
    jobs = _pipeline(DISTILL, tmp_path, start="distill")
    assert _waits(jobs, sbatch) == {"distill": [], "export": ["distill"], "evaluate": ["distill", "export"]}
    sbatch.clear()
    jobs = _pipeline(DISTILL, tmp_path, start="regenerate", until="export")
    assert _waits(jobs, sbatch) == {"regenerate": [], "distill": ["regenerate"], "export": ["distill"]}
    sbatch.clear()
    job = submit.submit(get_recipe(DISTILL), DISTILL, "export", tmp_path / "run", say=lambda line: None)
    assert (job.stage, sbatch) == ("export", [("export", None)])


def test_the_draft_opd_chain_trains_on_policy_after_its_rollout_job(sbatch, tmp_path):
    name = "qwen3_8b_osprey_opd_offline_distill_2gpu_h100_bf16"  # rollout, distill (on-policy), export, evaluate
    jobs = _pipeline(name, tmp_path)
    assert [job.stage for job in jobs] == ["rollout", "distill", "export", "evaluate"]
    assert _waits(jobs, sbatch) == {"rollout": [], "distill": ["rollout"], "export": ["distill"],
                                    "evaluate": ["distill", "export"]}  # fmt: skip


def test_the_online_draft_opd_chain_rolls_out_inside_its_distill_job(sbatch, tmp_path):
    name = "qwen3_8b_osprey_opd_distill_2gpu_h100_bf16"  # the authors' loop: distill (on-policy), export, evaluate
    jobs = _pipeline(name, tmp_path)
    assert [job.stage for job in jobs] == ["distill", "export", "evaluate"]
    assert _waits(jobs, sbatch) == {"distill": [], "export": ["distill"], "evaluate": ["distill", "export"]}


def test_chain_stages_checks_from_and_until_against_the_chain():
    recipe = get_recipe(DISTILL)
    assert submit.chain_stages(recipe) == list(recipe.chain)
    assert submit.chain_stages(recipe, until="adapt") == ["adapt"]
    assert submit.chain_stages(recipe, "distill", "distill") == ["distill"]
    with pytest.raises(ValueError, match=r"^--from prune: recipe .* runs adapt, regenerate, distill"):
        submit.chain_stages(recipe, start="prune")
    with pytest.raises(ValueError, match=r"^--until extract: "):
        submit.chain_stages(recipe, until="extract")
    with pytest.raises(ValueError, match=r"^--from export comes after --until distill"):
        submit.chain_stages(recipe, "export", "distill")


def test_a_refused_sbatch_stops_the_chain_naming_the_script(monkeypatch, tmp_path):
    def run(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="sbatch: error: invalid partition\n")

    monkeypatch.setattr(submit, "_sbatch", lambda: "sbatch")
    monkeypatch.setattr(submit.subprocess, "run", run)
    refused = r"sbatch .*/adapt-\S+\.sbatch failed \(1\): sbatch: error: invalid partition"
    with pytest.raises(RuntimeError, match=refused):
        _pipeline(DISTILL, tmp_path)


def test_a_changed_input_is_refused_naming_the_recorded_and_the_current_sha256(tmp_path):
    out = tmp_path / "regenerated"
    out.mkdir()
    data = out / "train.jsonl"
    data.write_text('{"id": 1}\n')
    write_provenance(out, "regenerate", {}, {"train": data})
    recorded = digest(data)
    assert check_input("--data", data) == {"path": str(data.resolve()), "sha256": recorded}
    data.write_text('{"id": 2}\n')
    current = digest(data)
    with pytest.raises(ProvenanceError) as refused:
        check_input("--data", data)
    message = str(refused.value)
    assert f"input --data {data} has sha256 {current[:12]}..." in message
    assert f"the regenerate stage that wrote it recorded {recorded[:12]}... in {out / 'provenance.json'}" in message
    assert recorded[:12] != current[:12]
    # An input no stage recorded is only hashed.
    (tmp_path / "mine.jsonl").write_text("{}\n")
    assert check_input("--data", tmp_path / "mine.jsonl")["sha256"] == digest(tmp_path / "mine.jsonl")
    assert json.loads((out / "provenance.json").read_text())["outputs"]["train"]["sha256"] == recorded
