"""Token cache benchmark: what a restarted rank pays to find its cache, and what parallel
tokenizing buys a build. All in one run, each figure beside its anchor:

  (a) reopen: ``open_tokens`` on a committed cache whose source digests are recorded
      (a restart: stats only), against hashing the whole corpus with sha256 (what every open
      cost before the digests were kept; measured here on the same files);
  (b) build: a cold build with ``--workers`` tokenizing processes against the same build
      with one (the ``ByteTokenizer``; a real tokenizer spends more per byte, so it gains
      more).

Medians over --reps. The corpus is made here (no download).

    .venv/bin/python bench/token_cache.py [--mib 64] [--workers 2] [--reps 3]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import hashlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchlib import parser, print_figures

from spottrain.agent.sdk.token_cache import ByteTokenizer, open_tokens


def make_corpus(root: Path, mib: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    line = "".join(f"spot node {i % 97} trains step {i} of a long run; " for i in range(4)) + "\n"
    block = (line * ((1 << 20) // len(line) + 1)).encode()[: 1 << 20]
    files = []
    for i in range(4):
        f = root / f"part-{i}.txt"
        with open(f, "wb") as out:
            for _ in range(mib // 4):
                out.write(block)
        files.append(f)
    return files


def timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def sha_all(files: list[Path]) -> None:
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as src:
            while block := src.read(1 << 20):
                h.update(block)


def main() -> int:
    p = parser(__doc__.splitlines()[0], reps=3)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-token-cache-"))
    try:
        files = make_corpus(tmp / "corpus", args.mib)
        tok = ByteTokenizer()
        build: dict[int, list[float]] = {1: [], args.workers: []}
        for _ in range(args.reps):
            for workers in build:
                cache = tmp / f"cache-{workers}"
                shutil.rmtree(cache, ignore_errors=True)
                build[workers].append(
                    timed(
                        lambda c=cache, w=workers: open_tokens(
                            files, tok, c, workers=w, parallel_min_bytes=0
                        )
                    )
                )
        cache = tmp / "cache-1"
        reopen = [timed(lambda: open_tokens(files, tok, cache)) for _ in range(args.reps)]
        hashing = [timed(lambda: sha_all(files)) for _ in range(args.reps)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    med = {w: statistics.median(v) for w, v in build.items()}
    figures = {
        "corpus_mib": args.mib,
        "reopen_s": round(statistics.median(reopen), 4),
        "rehash_anchor_s": round(statistics.median(hashing), 4),
        "reopen_speedup": round(statistics.median(hashing) / statistics.median(reopen), 1),
        "build_serial_s": round(med[1], 3),
        f"build_{args.workers}proc_s": round(med[args.workers], 3),
        "build_speedup": round(med[1] / med[args.workers], 2),
    }
    print(f"corpus {args.mib} MiB, ByteTokenizer, medians of {args.reps}")
    print(
        f"  reopen (digests kept)   {figures['reopen_s']:.4f} s   anchor: sha256 of the corpus "
        f"{figures['rehash_anchor_s']:.4f} s   ({figures['reopen_speedup']}x)"
    )
    print(
        f"  build, {args.workers} processes     {med[args.workers]:.3f} s   anchor: 1 process "
        f"{med[1]:.3f} s   ({figures['build_speedup']}x)"
    )
    print_figures(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
