"""The drafter's hidden-state norm per chain step on trained drafters: the attention-drift measurement.

    python benchmarks/drift_norms.py --store OUT/stores/chat --drafter eagle3=OUT/drafters/eagle3_chat_s0 \\
        --drafter eagle3_drift=OUT/drafters/eagle3_drift_chat_s0 [--samples 16] [--steps 8]

Each drafter unrolls --steps chain steps (training-time test, as in training and drafting) over the first
--samples samples of an extracted hidden-state store (the target's captured states and tokens), and the
script prints, per step, the mean L2 norm over the samples' assistant tokens of the drafter's pre-norm hidden
state and of the state it hands to the next step (the same one without --hidden-post-norm, its final norm
with it), then one JSON line. Steps past the drafter's training depth show whether the norm keeps growing
when a chain runs longer than it was trained for.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_norms(drafter, store, samples: int, steps: int) -> dict[str, list[float]]:
    """Per chain step: the token-weighted mean L2 norm of the pre-norm hidden state ("hidden") and of the state
    handed on ("passed"), over the assistant tokens of the store's first `samples` samples."""
    hidden_sum, passed_sum, count = torch.zeros(steps), torch.zeros(steps), 0
    dtype = next(drafter.parameters()).dtype
    for index in range(min(samples, len(store))):
        sample = store[index]
        mask = sample["loss_mask"].bool()
        if not mask.any():
            continue
        ids, aux = sample["input_ids"][None], sample["aux_hidden"][None].to(dtype)
        with torch.no_grad():
            _, hidden = drafter.ttt_forward(ids, aux, steps, return_hidden=True)
        for k, h in enumerate(hidden):
            hidden_sum[k] += h[0][mask].float().norm(dim=-1).sum()
            passed_sum[k] += drafter.passed_state(h)[0][mask].float().norm(dim=-1).sum()
        count += int(mask.sum())
    if count == 0:
        raise ValueError(f"the store's first {samples} samples hold no assistant token.")
    return {"hidden": (hidden_sum / count).tolist(), "passed": (passed_sum / count).tolist(), "tokens": count}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", required=True, help="an extracted hidden-state store (the target's states)")
    parser.add_argument("--drafter", action="append", required=True, metavar="NAME=DIR", help="repeatable")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="chain steps to unroll (training used 5 in the demo)")
    args = parser.parse_args(argv)
    from megatron_osprey.data.hidden_state_store.reader import HiddenStateStore
    from megatron_osprey.eval.loading import load_drafter

    store = HiddenStateStore(args.store, dtype=torch.float32)
    results = {}
    for spec in args.drafter:
        name, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"--drafter {spec}: expected NAME=DIR.")
        drafter = load_drafter(path).drafter.float()
        post = bool(drafter.config.hidden_post_norm)
        results[name] = {"hidden_post_norm": post, **step_norms(drafter, store, args.samples, args.steps)}
        hidden = " ".join(f"{v:7.2f}" for v in results[name]["hidden"])
        passed = " ".join(f"{v:7.2f}" for v in results[name]["passed"])
        print(f"{name:<24} hidden {hidden}")
        print(f"{'':<24} passed {passed}   (post-norm: {post}, {results[name]['tokens']} tokens)")
    print(json.dumps({"store": args.store, "samples": args.samples, "steps": args.steps, "drafters": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
