"""CLI: write random-weight Qwen3.5 checkpoints.

python -m deltaserve.models.testing write --shape tiny --moe --layout mlx --bits 4 --out DIR
python -m deltaserve.models.testing demo DIR       # the README's offline demo model
python -m deltaserve.models.testing cached NAME    # print (and create) a cached test checkpoint
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deltaserve.models.testing import CACHED, SHAPES, cached_checkpoint, write_checkpoint

DEMO_SHAPE = "small"  # hidden 256, 8 layers (6 DeltaNet + 2 attention), dense, peaked


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deltaserve.models.testing", description=__doc__
    )
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write one checkpoint")
    write.add_argument("--out", required=True, help="empty or missing output directory")
    write.add_argument("--shape", default="tiny", choices=list(SHAPES))
    write.add_argument("--moe", action="store_true", help="MoE variant of tiny / small")
    write.add_argument("--layout", default="hf", choices=["hf", "mlx"])
    write.add_argument("--bits", type=int, help="quantize (layout mlx): 4 or 8")
    write.add_argument("--seed", type=int, default=0)
    write.add_argument("--flat", action="store_true", help="do not peak the logits")
    write.add_argument("--experts", default="fused", choices=["fused", "per_expert"])
    write.add_argument("--shards", type=int, help="number of safetensors files")
    write.add_argument(
        "--inexact-gains", action="store_true", help="norm weights not on the bf16 grid"
    )
    demo = commands.add_parser("demo", help="write the small peaked demo checkpoint")
    demo.add_argument("out")
    cached = commands.add_parser("cached", help="print the path of a cached test checkpoint")
    cached.add_argument("name", choices=[*CACHED, *SHAPES])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            path = write_checkpoint(args.out, shape=DEMO_SHAPE)
        elif args.command == "cached":
            path = cached_checkpoint(args.name)
        else:
            if args.bits is not None and args.layout != "mlx":
                raise ValueError("--bits quantizes the mlx layout: add --layout mlx")
            path = write_checkpoint(
                args.out,
                shape=args.shape,
                moe=args.moe,
                layout=args.layout,
                bits=args.bits,
                seed=args.seed,
                peaked=not args.flat,
                experts=args.experts,
                shards=args.shards,
                exact_gains=not args.inexact_gains,
            )
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
