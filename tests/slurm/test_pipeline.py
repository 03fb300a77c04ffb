"""`osprey pipeline smollm2_cpu_smoke` on the local Slurm: every stage as its own sbatch job with afterok
dependencies, the multi-rank ones as 2 srun tasks under gloo, on the real target (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from launcher.cli import main as osprey
from launcher.cluster import wait_for_jobs
from megatron_osprey.base.provenance import digest, read_provenance
from megatron_osprey.demo import corpora
from megatron_osprey.recipes.cpu import SMOKE_DOMAINS

pytestmark = pytest.mark.slurm
RECIPE = "smollm2_cpu_smoke"


def _inputs(root: Path) -> None:
    """The recipe's external inputs at smoke size, from the demo's corpora: the model, text, prompts, eval sets."""
    from megatron_osprey.assets.models import write_model

    write_model("smollm2-135m-instruct", root / "models" / "smollm2", overwrite=True)
    text = corpora.pretraining_text(["chat", "code"], 20_000, seed=0)
    corpora.write_jsonl(root / "data" / "pretrain_text.jsonl", [{"text": t} for t in text])
    for domain in SMOKE_DOMAINS:
        rows = corpora.domain_conversations(domain, 12, seed=0)
        corpora.write_jsonl(root / "data" / "prompts" / f"{domain}.jsonl", rows[:8])
        corpora.write_jsonl(root / "data" / "eval" / f"{domain}.jsonl", rows[8:])


@pytest.fixture(scope="module")
def chain(slurm_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("smoke")
    _inputs(root)
    run_dir = root / "run"
    lines = []
    argv = ["pipeline", RECIPE, "--run-dir", str(run_dir), "--set", f"paths.root={root}", "--python", sys.executable]
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert osprey(argv) == 0
    lines = [line.split() for line in buffer.getvalue().splitlines() if line.strip()]
    jobs = {stage: job for stage, job in lines}
    start = time.monotonic()
    states = wait_for_jobs(list(jobs.values()), slurm_cluster["env"], timeout=1500)
    return {"root": root, "run_dir": run_dir, "jobs": jobs, "states": states, "seconds": time.monotonic() - start}


def _log_tail(run_dir: Path) -> str:
    logs = sorted((run_dir / "logs").glob("*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs[-3:])


def test_every_stage_ran_as_its_own_job_and_succeeded(chain):
    jobs, states = chain["jobs"], chain["states"]
    assert list(jobs) == ["prune", "preprocess", "pretrain", "adapt", "regenerate", "extract", "distill", "export",
                          "evaluate"]  # fmt: skip
    summary = {stage: (jobs[stage], states[jobs[stage]].state, states[jobs[stage]].run_time_s) for stage in jobs}
    print(json.dumps(summary, indent=1))
    (chain["run_dir"] / "jobs.json").write_text(json.dumps(summary))
    bad = {s: v for s, v in summary.items() if v[1] != "COMPLETED"}
    assert not bad, f"{bad}\n{_log_tail(chain['run_dir'])}"


def test_the_regenerate_job_served_the_target_with_vllm_where_the_engine_is_installed(chain):
    """With VLLM_PYTHON (or the checkout's .venv-vllm) the CPU job's server is vLLM's, else the local server."""
    import os

    from megatron_osprey.base.engines import EngineUnavailable, engine_python

    logs = chain["run_dir"] / "logs"
    text = next(p.read_text() for p in logs.glob("osprey-regenerate-*.log"))
    try:
        engine_python("vllm", None, os.environ, repo=Path(__file__).resolve().parents[2])
    except EngineUnavailable:
        assert "servers: local" in text
        return
    assert "servers: vllm" in text, text[-2000:]
    (server_log,) = logs.glob("osprey-regenerate-*-server-*.log")
    served = server_log.read_text()
    assert "vllm.entrypoints.openai.api_server" in served or "Starting vLLM" in served, served[-2000:]
    assert served.count("POST /v1/chat/completions") >= 8  # the 8 training prompts, a request per user turn
    # The job's key (48 hex digits from /dev/urandom) appears in no log or output.
    written = [text, served, (chain["run_dir"] / "regenerate" / "conversations.jsonl").read_text()]
    assert not any(re.search(r"\b[0-9a-f]{48}\b", t) for t in written)


def test_the_evaluate_job_served_the_drafter_in_vllm_where_the_engine_is_installed(chain):
    """The smoke chain's eval job (eval_vllm.sbatch): lossless in vLLM and its AL beside the reference engine's."""
    import os

    from megatron_osprey.base.engines import EngineUnavailable, engine_python

    results = json.loads((chain["run_dir"] / "evaluate" / "results.json").read_text())
    try:
        engine_python("vllm", None, os.environ, repo=Path(__file__).resolve().parents[2])
    except EngineUnavailable:
        assert "vllm" not in results
        return
    section = results["vllm"]
    print(json.dumps({name: d["acceptance_length"] for name, d in section["drafters"].items()}))
    assert section["lossless"] == {"checked": True, "mismatches": []}
    assert section["agreement"]["failures"] == []
    (record,) = section["drafters"].values()
    assert sorted(record["splits"]) == sorted(SMOKE_DOMAINS) and record["acceptance_length"] >= 1.0


def test_adapt_read_what_pretrain_wrote_by_provenance_hash(chain):
    run_dir = chain["run_dir"]
    pretrain, adapt = read_provenance(run_dir / "pretrain"), read_provenance(run_dir / "adapt")
    assert adapt["inputs"]["backbone"]["path"] == str((run_dir / "pretrain" / "hf").resolve())
    assert (
        adapt["inputs"]["backbone"]["sha256"] == pretrain["outputs"]["hf"]["sha256"] == digest(run_dir / "pretrain/hf")
    )
    pruned = read_provenance(run_dir / "prune")
    assert pruned["outputs"]["hf"]["sha256"] != pretrain["outputs"]["hf"]["sha256"]  # pretraining changed the weights
    assert pretrain["recipe"] == RECIPE and "--recipe" in pretrain["command"]


def test_the_multi_rank_stages_ran_two_srun_tasks(chain):
    logs = {p.name: p.read_text() for p in (chain["run_dir"] / "logs").glob("*.log")}
    for stage in ("pretrain", "extract", "distill"):
        text = next(t for name, t in logs.items() if name.startswith(f"osprey-{stage}-"))
        ranks = sorted(set(re.findall(r"osprey-task: rank (\d) of 2", text)))
        assert ranks == ["0", "1"], (stage, text[-2000:])


def test_evaluation_was_lossless_and_the_export_loads_back(chain):
    results = json.loads((chain["run_dir"] / "evaluate" / "results.json").read_text())
    table = {(c["drafter"], c["split"]): c["summary"]["mean_acceptance_length"] for c in results["cells"]}
    print(json.dumps({f"{d} on {s}": round(al, 3) for (d, s), al in table.items()}, indent=1))
    assert sorted(s for _, s in table) == sorted(SMOKE_DOMAINS) and all(al >= 1.0 for al in table.values())
    assert results["lossless"] == {"checked": True, "mismatches": []}
    assert sum(len(c["requests"]) for c in results["cells"]) == 4  # 2 prompts in each of the 2 domains
    from megatron_osprey.eval.loading import load_drafter

    loaded = load_drafter(chain["run_dir"] / "export")
    assert loaded.source == "sglang"


def test_a_resubmitted_stage_is_refused_when_its_input_changed(chain, slurm_cluster):
    # Edit what pretrain wrote, then rerun adapt by hand: provenance refuses the changed backbone, naming both.
    run_dir = chain["run_dir"]
    weights = next((run_dir / "pretrain" / "hf").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    code = osprey(["adapt", RECIPE, "--run-dir", str(run_dir), "--set", f"paths.root={chain['root']}",
                   "--", "--overwrite"])  # fmt: skip
    assert code == 1  # the stage's error, through `osprey adapt`'s local run


@pytest.fixture(scope="module")
def opd_chain(chain, slurm_cluster):
    """`osprey pipeline smollm2_cpu_opd_smoke`: Draft-OPD from the smoke chain's distilled drafter and prompts."""
    root, run_dir = chain["root"], chain["run_dir"]
    opd_dir = root / "opd"
    sets = [f"paths.root={root}", f"paths.sft={run_dir / 'distill'}"]
    sets += [f"paths.conversations={run_dir / 'regenerate' / 'conversations.jsonl'}"]
    argv = ["pipeline", "smollm2_cpu_opd_smoke", "--run-dir", str(opd_dir), "--python", sys.executable]
    argv += [item for text in sets for item in ("--set", text)]
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert osprey(argv) == 0
    jobs = dict(line.split() for line in buffer.getvalue().splitlines() if line.strip())
    states = wait_for_jobs(list(jobs.values()), slurm_cluster["env"], timeout=900)
    return {"run_dir": opd_dir, "sft": run_dir / "distill", "jobs": jobs, "states": states}


def test_draft_opd_runs_as_rollout_then_on_policy_jobs(opd_chain):
    jobs, states = opd_chain["jobs"], opd_chain["states"]
    assert list(jobs) == ["rollout", "distill", "export", "evaluate"]
    summary = {stage: (jobs[stage], states[jobs[stage]].state, states[jobs[stage]].run_time_s) for stage in jobs}
    print(json.dumps(summary, indent=1))
    bad = {s: v for s, v in summary.items() if v[1] != "COMPLETED"}
    assert not bad, f"{bad}\n{_log_tail(opd_chain['run_dir'])}"
    run_dir = opd_chain["run_dir"]
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    for stage in ("rollout", "distill"):
        text = next(t for name, t in logs.items() if name.startswith(f"osprey-{stage}-"))
        assert sorted(set(re.findall(r"osprey-task: rank (\d) of 2", text))) == ["0", "1"], (stage, text[-2000:])
    from megatron_osprey.data.hidden_state_store import HiddenStateStore

    store = HiddenStateStore(run_dir / "rollout")
    assert len(store) == 4 and store.header.rollout_steps == 3
    assert len(store.manifest["writers"]) == 2  # the Megatron-Core target, one replica per rank
    assert sum(len(store[i]["rollout"]) for i in range(len(store))) > 4
    # each job read what the one before it wrote, by provenance hash
    rollout, distill = read_provenance(run_dir / "rollout"), read_provenance(run_dir / "distill")
    assert (
        rollout["inputs"]["drafter"]["sha256"] == read_provenance(opd_chain["sft"])["outputs"]["checkpoint"]["sha256"]
    )
    assert distill["inputs"]["hidden_states"]["path"] == str((run_dir / "rollout").resolve())
    assert distill["config"]["data"]["mode"] == "on-policy"
    results = json.loads((run_dir / "evaluate" / "results.json").read_text())
    assert results["lossless"] == {"checked": True, "mismatches": []}
