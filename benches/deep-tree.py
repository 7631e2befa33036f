#!/usr/bin/env python3
"""Write the deep-tree dataset of docs/benchmarks.md: 11,111 directories
(five levels, ten subdirectories each down to the fourth) and 30,000 files of
1-9 KiB, half random and half text, spread over all of them: a tree whose
restore waits on its directories' trees rather than on its data.

Usage: benches/deep-tree.py DIR [FILES]
"""
import os
import random
import sys

if len(sys.argv) not in (2, 3) or sys.argv[1].startswith("-"):
    sys.exit(__doc__.strip())
root = sys.argv[1]
files = int(sys.argv[2]) if len(sys.argv) > 2 else 30_000
random.seed(7)
directories = []


def make(path, depth):
    os.makedirs(path, exist_ok=True)
    directories.append(path)
    if depth < 4:
        for child in range(10):
            make(os.path.join(path, f"d{child}"), depth + 1)


make(root, 0)
for index in range(files):
    directory = directories[index % len(directories)]
    size = random.randint(1024, 9 * 1024)
    body = random.randbytes(size // 2) + (b"line of text %d\n" % index) * (size // 32)
    with open(os.path.join(directory, f"f{index}.txt"), "wb") as handle:
        handle.write(body)
