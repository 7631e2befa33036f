#!/usr/bin/env python3
"""Write the many-small-files dataset of docs/benchmarks.md: 200,000 files of
256-4,096 bytes of words, 200 per directory, in 1,000 directories.

Usage: benches/many-small-files.py DIR [FILES]
"""
import os
import random
import sys

root = sys.argv[1]
files = int(sys.argv[2]) if len(sys.argv) > 2 else 200_000
random.seed(1)
words = b"volume claim cluster node storage backup restore chunk pack index snapshot".split()
for index in range(files):
    directory = os.path.join(root, f"d{index // 20000:02d}", f"e{(index // 200) % 1000:03d}")
    if index % 200 == 0:
        os.makedirs(directory, exist_ok=True)
    size = random.randint(256, 4096)
    body = b" ".join(random.choice(words) for _ in range(size // 6))[:size]
    with open(os.path.join(directory, f"f{index % 200:03d}.txt"), "wb") as handle:
        handle.write(body)
