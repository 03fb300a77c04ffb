"""Run inside vLLM's environment (not the project's): serve each exported drafter with the target and record
what its draft model saw and computed on its first draft step, plus greedy token ids.

    VLLM_PYTHON tests/vllm_probe.py JOB.json

JOB: {"target", "out", "prompts": [[token ids]], "max_tokens", "drafters": [{"name", "dir"}], optional
"enforce_eager" (default true)}. Per drafter, one LLM (float32), all in this process (run with
VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core and worker stay in-process, about 6 s per LLM here instead of
about 70 s). The first prompt is prefilled alone with max_tokens 2 while the draft model's
``combine_hidden_states`` (input: the target's captured aux states [n, 3*Ht]) and ``compute_logits``
(output: target-vocabulary logits [1, V]) are wrapped to save the aux input of the first call and the
logits of the first round's draft steps 1 and 2; then every prompt is decoded greedily. Writes OUT/NAME.pt
({"error"} when vLLM refused the drafter). Imports only vLLM, torch and the stdlib.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def _install_probe(worker, path: str) -> str:
    """In the worker: wrap the draft model so its first aux input and first logits are saved to `path`."""
    import torch

    model = worker.model_runner.drafter.model
    seen: dict = {}
    combine, logits_fn = model.combine_hidden_states, model.compute_logits

    def save():
        if "aux" in seen and len(seen.get("logits", [])) == 2:
            torch.save(dict(seen, arch=type(model).__name__), path)

    def combine_hidden_states(hidden_states):
        if "aux" not in seen:
            seen["aux"] = hidden_states.detach().float().cpu().clone()
        return combine(hidden_states)

    def compute_logits(hidden_states):
        logits = logits_fn(hidden_states)
        calls = seen.setdefault("logits", [])
        if len(calls) < 2:  # draft steps 1 and 2 of the first round
            calls.append(logits.detach().float().cpu().clone())
            save()
        return logits

    model.combine_hidden_states, model.compute_logits = combine_hidden_states, compute_logits
    return type(model).__name__


def run_drafter(job: dict, drafter: dict) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.time()
    llm = LLM(
        model=job["target"],
        dtype="float32",
        enforce_eager=job.get("enforce_eager", True),
        max_model_len=1024,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
        distributed_executor_backend="uni",  # with VLLM_ENABLE_V1_MULTIPROCESSING=0: no process spawned
        speculative_config={"method": "eagle3", "model": drafter["dir"], "num_speculative_tokens": 3},
    )
    load_s = time.time() - started
    probe_path = f"{job['out']}/{drafter['name']}.probe.pt"
    arch = llm.collective_rpc(_install_probe, args=(probe_path,))[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], greedy, use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], greedy, use_tqdm=False)
    probe = torch.load(probe_path)
    result = {
        "arch": arch,
        "first_tokens": list(first[0].outputs[0].token_ids),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "aux": probe["aux"],
        "logits": probe["logits"],
        "load_s": load_s,
        "total_s": time.time() - started,
    }
    del llm
    return result


def main(path: str) -> int:
    import torch
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    job = json.loads(open(path).read())
    for drafter in job["drafters"]:
        try:
            result = run_drafter(job, drafter)
        except Exception as exc:  # recorded for the test to report; the next drafter still runs
            result = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            gc.collect()
            cleanup_dist_env_and_memory()  # the next LLM in this process sets up its own groups
        torch.save(result, f"{job['out']}/{drafter['name']}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
