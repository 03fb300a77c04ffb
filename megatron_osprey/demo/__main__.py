"""python -m megatron_osprey.demo --output demo_out"""

import argparse
import json
from pathlib import Path

from megatron_osprey.demo import stage1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Toy-scale Osprey pipeline on CPU.")
    parser.add_argument("--output", type=Path, default=Path("demo_out"))
    parser.add_argument("--num-layers", type=int, default=2, help="blocks the pruned backbone keeps")
    args = parser.parse_args(argv)
    report = stage1.run(args.output, num_layers=args.num_layers)
    print(json.dumps(report, indent=2))
    if report["max_abs_logit_diff_vs_truncated_source"] > 1e-4:
        print("demo: the pruned backbone does not reproduce the source's first layers")
        return 1
    print(f"demo: wrote {args.output}/backbone (megatron/, hf/, run_config.yaml) and {args.output}/report.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
