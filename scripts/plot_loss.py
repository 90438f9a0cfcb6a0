"""Draw the loss curves of one or more runs from their TensorBoard logs (``--tensorboard-dir``) to a PNG.

    python scripts/plot_loss.py runs/qwen-tiny --output loss.png
    python scripts/plot_loss.py runs/a runs/b --labels baseline resumed --output compare.png

Training loss ("lm loss") as a line per run, validation loss ("lm loss validation") as markers. Needs
tensorboard and matplotlib (``pip install -e .[plot]``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TRAIN, VALID = "lm loss", "lm loss validation"


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from every event file under ``log_dir``; later writes of a step win (a
    resumed run logging into the same directory)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(log_dir.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"{log_dir} has no TensorBoard event files: pass the --tensorboard-dir of a run")
    scalars: dict[str, dict[int, float]] = {}
    for file in files:
        accumulator = EventAccumulator(str(file), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return {tag: sorted(values.items()) for tag, values in scalars.items()}


def plot(runs: dict[str, dict], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for label, scalars in runs.items():
        if TRAIN in scalars:
            steps, values = zip(*scalars[TRAIN])
            line, = axes.plot(steps, values, label=f"{label} train", linewidth=1.2)
            color = line.get_color()
        else:
            color = None
        if VALID in scalars:
            steps, values = zip(*scalars[VALID])
            axes.plot(steps, values, "o--", color=color, label=f"{label} validation", markersize=4)
    axes.set_xlabel("iteration")
    axes.set_ylabel("lm loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(output, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dirs", nargs="+", type=Path, help="--tensorboard-dir of each run")
    parser.add_argument("--labels", nargs="+", help="one per run (default: the directory names)")
    parser.add_argument("--output", type=Path, default=Path("loss.png"))
    args = parser.parse_args(argv)
    labels = args.labels or [d.name for d in args.log_dirs]
    if len(labels) != len(args.log_dirs):
        print(f"error: {len(labels)} labels for {len(args.log_dirs)} runs", file=sys.stderr)
        return 2
    try:
        runs = {label: read_scalars(d) for label, d in zip(labels, args.log_dirs)}
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not any(TRAIN in r or VALID in r for r in runs.values()):
        print(f"error: no '{TRAIN}' scalars in {', '.join(map(str, args.log_dirs))}", file=sys.stderr)
        return 2
    plot(runs, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
