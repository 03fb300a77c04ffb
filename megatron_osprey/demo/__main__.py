"""python -m megatron_osprey.demo [--full] [--output demo_out]: the Osprey pipeline at toy scale on CPU."""

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The whole Osprey pipeline at toy scale on CPU.")
    parser.add_argument("--output", type=Path, default=Path("demo_out"))
    parser.add_argument("--full", action="store_true", help="all five training domains (the 5x5 matrix)")
    parser.add_argument("--stage1-only", action="store_true", help="only build a tiny LM and prune it (seconds)")
    args = parser.parse_args(argv)
    if args.stage1_only:
        from megatron_osprey.demo import stage1

        report = stage1.run(args.output)
        print(json.dumps(report, indent=2))
        return 0 if report["max_abs_logit_diff_vs_truncated_source"] <= 1e-4 else 1
    from megatron_osprey.demo.pipeline import DemoConfig, run_demo

    cfg = DemoConfig.full() if args.full else DemoConfig.quick()
    try:
        report = run_demo(cfg, args.output)
    except RuntimeError as error:
        print(f"demo failed: {error}", file=sys.stderr)
        return 1
    print((args.output / "report.md").read_text())
    gains = report.get("osprey_gain_over_eagle3") or {}
    print(f"demo: wrote {args.output}/report.md, report.json and heatmap.png "
          f"(Osprey vs EAGLE-3 mean AL gain {100 * (gains.get('mean') or 0):+.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
