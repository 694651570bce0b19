#!/usr/bin/env bash
# Stages what benchmarks/device/setup.sh reads into the ignored .gpu/ of this checkout (run here, not on the
# device): ../shared/tools/gpu_stage.sh's model, wheels and data, the model split in two halves, the data in its
# two parts, and the torchao wheel (from PyPI) that the 4-bit rows need and the GPU image lacks.
set -euo pipefail
top="$(git rev-parse --show-toplevel)"
cd "$top"
bash ../shared/tools/gpu_stage.sh > /dev/null
cat .gpu/m0/part0 .gpu/m1/part1 .gpu/m2/part2 > .gpu/joined.gguf
mkdir -p .gpu/pa .gpu/pb .gpu/wt .gpu/prose
head -c 50000000 .gpu/joined.gguf > .gpu/pa/a
tail -c +50000001 .gpu/joined.gguf > .gpu/pb/b
rm -rf .gpu/joined.gguf .gpu/m0 .gpu/m1 .gpu/m2
cp .gpu/data/wikitext-2/valid.txt .gpu/wt/
cp .gpu/data/prose/* .gpu/prose/
python3 -m pip download -q --no-deps "torchao==0.18.0" -d .gpu/whl
du -sh .gpu/*
