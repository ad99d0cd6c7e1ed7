"""Write the monitor's reference run (homerlhf/app/reference/demo_fast.json) from a demo's run directory:
its metrics.jsonl and config.yaml, through :func:`homerlhf.app.monitor_reference.build`.

    homerlhf demo --fast --out /tmp/demo
    python scripts/demo_reference.py /tmp/demo --cpu "2-core AMD EPYC (Zen 4)" --date 2026-12-05
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from homerlhf.app import monitor_reference
from homerlhf.app.monitor import read_jsonl

OUT = Path(__file__).resolve().parents[1] / "homerlhf" / "app" / "reference" / monitor_reference.FILE


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the demo's RL run directory (metrics.jsonl, config.yaml)")
    parser.add_argument("--cpu", required=True, help="the CPU it ran on, as the docs name it")
    parser.add_argument("--date", required=True, help="the day it ran, YYYY-MM-DD")
    parser.add_argument("--command", default="homerlhf demo --fast", help="what was run")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    rows = read_jsonl(args.run_dir / "metrics.jsonl")
    config_file = args.run_dir / "config.yaml"
    if not rows or not config_file.is_file():
        print(f"error: {args.run_dir} holds no metrics.jsonl rows or no config.yaml; pass a demo's run directory",
              file=sys.stderr)
        return 2
    config = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    reference = monitor_reference.build(rows, config, args.command, args.cpu, args.date)
    args.out.write_text(monitor_reference.dumps(reference), encoding="utf-8")
    print(f"wrote {args.out}: {reference['header']['iterations']} iterations, {reference['header']['applies_to']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
