"""What a large corpus costs each rank in memory with data=text (docs/gpt.md, "A GPT on text").

    python benchmarks/text_memory.py --mb 100          # writes a 100 MB corpus under a temp dir

Writes a corpus of --mb megabytes (varied ASCII lines), builds TextData as a rank would (scan,
rank 0's token file, the memory map), then draws --batches training batches. Prints the resident
memory before and after, split as Linux counts it: anonymous (this process's own heap: what grows
if a loader holds the corpus) and file-backed (pages of the mapped token file, shared by every rank
on the machine and dropped by the kernel under pressure).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from data.text import TextData  # noqa: E402


def rss_mb() -> dict[str, float]:
    """RssAnon and RssFile of this process, MiB (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "RssAnon", "RssFile")}


def write_corpus(path: Path, megabytes: int) -> None:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)] + ["the", "a", "of", "def", "return", "(", ")", ":"]
    with path.open("w", encoding="utf-8") as out:
        while out.tell() < megabytes * 10**6:
            out.write(" ".join(rng.choices(words, k=4000)) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--tokenizer", choices=("char", "byte"), default="char")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        write_corpus(corpus, args.mb)
        before = rss_mb()
        started = time.perf_counter()
        data = TextData(batch_size=32, block_size=256, path=str(corpus), tokenizer=args.tokenizer, cache_dir=tmp)
        scanned = time.perf_counter()
        data.prepare()  # rank 0's tokenization; the others skip it
        prepared = time.perf_counter()
        data.setup()
        loader = data.train_loader(0, 2, seed=0)
        for i, _ in enumerate(loader):
            if i + 1 == args.batches:
                break
        after = rss_mb()
        print(f"corpus {corpus.stat().st_size / 1e6:.0f} MB, {data.corpus.num_tokens} tokens ({args.tokenizer})")
        print(f"scan {scanned - started:.1f} s, tokenize (rank 0, once) {prepared - scanned:.1f} s")
        for key in before:
            grew = after[key] - before[key]
            print(f"{key:8s} before {before[key]:7.1f} MiB  after {after[key]:7.1f} MiB  (+{grew:.1f})")


if __name__ == "__main__":
    main()
