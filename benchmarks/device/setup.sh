# Source on the lent GPU machine from the checkout's root: `source benchmarks/device/setup.sh`. Idempotent, so
# every call of a warm machine begins with it. What it reads, staged in the ignored .gpu/ by stage.sh and
# carried one part a call (a call carries at most 64 MiB): .gpu/whl (wheels the GPU image lacks, installed once
# into /tmp/site, torchao's among them), .gpu/pa and .gpu/pb (the SmolLM2 GGUF in two halves, joined in /tmp/gsm
# once both arrived), .gpu/wt and .gpu/prose (WikiText-2 validation and the Gutenberg prose, into /tmp/gsm/data).
# /tmp survives only while the machine is warm.
mkdir -p /tmp/gsm/data
[ -d /tmp/site ] || { [ -d .gpu/whl ] && rm -rf /tmp/site.part && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site.part .gpu/whl/*.whl && mv /tmp/site.part /tmp/site; }
[ -f .gpu/pa/a ] && cp --update=none .gpu/pa/a /tmp/gsm/a
[ -f .gpu/pb/b ] && cp --update=none .gpu/pb/b /tmp/gsm/b
[ -d .gpu/wt ] && [ ! -d /tmp/gsm/data/wikitext-2 ] && cp -r .gpu/wt /tmp/gsm/data/wikitext-2
[ -d .gpu/prose ] && [ ! -d /tmp/gsm/data/prose ] && cp -r .gpu/prose /tmp/gsm/data/prose.tmp && mv /tmp/gsm/data/prose.tmp /tmp/gsm/data/prose
GSM_SMOLLM2_GGUF=/tmp/gsm/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GSM_SMOLLM2_GGUF" ] && [ -f /tmp/gsm/a ] && [ -f /tmp/gsm/b ]; then
  cat /tmp/gsm/a /tmp/gsm/b > "$GSM_SMOLLM2_GGUF.part" && mv "$GSM_SMOLLM2_GGUF.part" "$GSM_SMOLLM2_GGUF"
  sha256sum "$GSM_SMOLLM2_GGUF"
fi
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 GSM_SMOLLM2_GGUF
