#!/usr/bin/env python
"""The int8 hidden-state encoding's effect on a real drafter's TTT loss (issue 7's goal: under 1%).

    python benchmarks/store_ttt_loss.py [--drafter DEMO_OUT/drafters/osprey_chat --target DEMO_OUT/target/hf
                                         --data DEMO_OUT/data/chat_regenerated.jsonl]

Without arguments it builds the tiny target + adapted drafter of the tests. It runs the online target on
every conversation, then computes the drafter's TTT loss (5 steps, 0.8^k) from the exact states, from
bf16-rounded states and from the int8 encoding (per-token scales, 8 exact outliers, zstd), and prints
the relative changes and the bytes/token of each encoding against SpecForge's 8*Ht.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", type=Path, default=None, help="Stage 3 output or a distilled checkpoint")
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--seq-length", type=int, default=192)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from megatron_osprey.base.run_config import load_run_config
    from megatron_osprey.data.distill_data import ConversationSamples, pad_samples
    from megatron_osprey.data.hidden_state_quant import loss_delta_under_encoding
    from megatron_osprey.data.hidden_state_store import estimate_store_bytes
    from megatron_osprey.models.drafter.model import DrafterArch, build_drafter_model
    from megatron_osprey.models.target.lm_head import TargetHead
    from megatron_osprey.models.target.online import OnlineTarget
    from megatron_osprey.parallel import ParallelConfig, parallel_context
    from megatron_osprey.stages.distill import DistillConfig
    from megatron_osprey.training.checkpointing import load_model_weights
    from megatron_osprey.training.distillation import distill_forward_step

    with tempfile.TemporaryDirectory() as tmp:
        if args.drafter is None:
            from megatron_osprey.testing.distill_setup import build_distill_setup

            setup = build_distill_setup(Path(tmp))
            args.drafter, args.target, args.data = setup["drafter"], setup["target"], setup["data"]
        run_config = load_run_config(
            args.drafter if (args.drafter / "run_config.yaml").is_file() else next(args.drafter.glob("iter_*"))
        )
        arch = DrafterArch.from_dict(run_config["drafter"])
        weights = args.drafter / "megatron" if (args.drafter / "megatron").is_dir() else args.drafter
        with parallel_context(ParallelConfig()) as state:
            model = build_drafter_model(arch, state.config).eval()
            load_model_weights(weights, model)
            head = TargetHead.from_hf(args.target, model.t2d)
            target = OnlineTarget(args.target, state.config, state.device, arch.aux_layer_ids)
            source = ConversationSamples([str(args.data)], AutoTokenizer.from_pretrained(args.target), args.seq_length)
            samples = []
            for index in range(len(source)):
                batch = pad_samples([source[index]], args.seq_length, 0)
                aux, final = target(batch["input_ids"])
                # The store keeps [T, ...] per sample: drop the batch dimension, restore it in loss_fn.
                samples.append(
                    {
                        "input_ids": batch["input_ids"][0],
                        "loss_mask": batch["loss_mask"][0],
                        "aux_hidden": aux[0],
                        "final_hidden": final[0],
                    }
                )
            step = distill_forward_step(None, head, DistillConfig(), arch.draft_vocab_size, None)

            def loss_fn(sample):
                loss, loss_func = step(iter([{k: v[None] for k, v in sample.items()}]), model)
                return loss / loss_func(loss)[1].clamp(min=1)

            try:
                rows = [loss_delta_under_encoding(loss_fn, samples, encoding) for encoding in ("bf16", "int8")]
            except ValueError as error:
                print(f"error: --data {args.data} at --seq-length {args.seq_length}: {error}", file=sys.stderr)
                return 2
    tokens = sum(int(s["loss_mask"].numel()) for s in samples)
    ht = arch.target_hidden_size
    print(f"TTT loss of {args.drafter} on {len(samples)} conversations ({tokens} token slots), Ht={ht}:")
    for row in rows:
        per_token = estimate_store_bytes(tokens, ht, row.encoding, num_samples=len(samples)) / tokens
        print(
            f"  {row.encoding:5s}: loss {row.encoded_loss:.5f} vs exact {row.exact_loss:.5f} "
            f"({100 * row.relative_change:+.3f}%, worst sample {100 * row.max_sample_relative_change:.3f}%); "
            f"~{per_token:.0f} bytes/token = {per_token / (8 * ht):.3f}x SpecForge's 8*Ht (estimate)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
