#!/usr/bin/env bash
# Stages what benchmarks/device/setup.sh reads into the ignored .gpu/ of this checkout (run here, not on the
# device): the SmolLM2 GGUF (../shared/tools/get_smollm2.sh) in two halves, the shared data in two parts, the
# shared wheels and the torchao wheel (from PyPI) that the 4-bit rows need and the GPU image lacks.
set -euo pipefail
top="$(git rev-parse --show-toplevel)"
cd "$top"
shared="$(cd ../shared && pwd)"
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
gguf="$("$shared/tools/get_smollm2.sh")"
rm -rf .gpu && mkdir -p .gpu/pa .gpu/pb .gpu/wt .gpu/prose .gpu/whl
head -c 50000000 "$gguf" > .gpu/pa/a
tail -c +50000001 "$gguf" > .gpu/pb/b
cp "$shared"/data/wikitext-2/valid.txt .gpu/wt/
cp "$shared"/data/prose/* .gpu/prose/
cp "$shared"/wheels/*.whl .gpu/whl/
python3 -m pip download -q --no-deps "torchao==0.18.0" -d .gpu/whl
du -sh .gpu/*
