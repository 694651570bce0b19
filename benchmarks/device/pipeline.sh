#!/bin/bash
# The steps of a session's device run, one after another: copies the checkout to /tmp/w, runs each step of
# STEPS (default: by the card, below) with its output in /tmp/res/STEP.txt, logs each step's start, exit status and
# seconds in /tmp/res/pipeline.log (with the card, the code's digest: `python -m benchmarks.common`), and tars
# /tmp/res to /tmp/res.tar.gz after each step. Start it detached, so that it outlives the call:
#   source benchmarks/device/setup.sh; setsid nohup bash benchmarks/device/pipeline.sh >/dev/null 2>&1 </dev/null &
# then read it back with benchmarks/device/poll.sh, in calls that follow each other (an idle machine is released
# after 30 s). DATA is /tmp/gsm/data; EXPORT the 8k recipe's joint_long export the `train` step makes.
R=/tmp/res; D=/tmp/gsm/data; L=$R/pipeline.log; J=/tmp/J
mkdir -p $R
[ -f $L ] && mv $L $R/pipeline.before-$(date +%s).log  # poll.sh reads this run's log, not a finished one's
rm -rf /tmp/w && mkdir -p /tmp/w && tar cf - --exclude=./.gpu . | tar xf - -C /tmp/w  # this call's tree, not an earlier one's
cd /tmp/w
GPU=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)
echo "$GPU" >> $L
python -m benchmarks.common >> $L 2>&1
case "$GPU" in
  *H200*) STEPS=${STEPS:-"suite train gensmol scale_full"};;  # the rows that need more than 80 GB, and issue 45's suite
  *) STEPS=${STEPS:-"asq_ab train gensmol"};;
esac
need_model() { for _ in $(seq 120); do [ -f "$GSM_SMOLLM2_GGUF" ] && return 0; sleep 2; done; return 1; }
need_prose() { for _ in $(seq 120); do [ -d $D/prose ] && return 0; sleep 2; done; return 1; }
run_suite() { need_model; timeout 420 python -m pytest -n 8 -p no:cacheprovider --durations=25 tests/; }
run_train() {
  need_model; need_prose
  python -m benchmarks.long_context --eval-data $D/wikitext-2/valid.txt --train-data $D/prose --out $J --train joint_long --train-only
  mkdir -p $R/J && cp $J/stages/*.json $R/J/
}
run_train_frozen() {
  need_model; need_prose
  python -m benchmarks.long_context --eval-data $D/wikitext-2/valid.txt --train-data $D/prose --out /tmp/JF \
    --export gate_only_long=$J/runs/gate_only_long/export --train joint_long --train-only \
    --long-override train.base=frozen output.export_base_weights=false
}
run_gensmol() { need_model; python -m benchmarks.generate --eval-data $D/wikitext-2/valid.txt --rows smollm2_8k_bs1,smollm2_8k_bs16 --fused-decode --smollm2-export $J/runs/joint_long/export --result $R/generate_smollm2.json; }
run_gen8b() { python -m benchmarks.generate --eval-data $D/wikitext-2/valid.txt --rows 8b_32k_bs16,8b_128k_bs1,8b_32k_bs1 --methods dense_static_compiled,dense_engine --fused-decode --dense-block-kernel --result $R/generate_8b.json; }
run_gen8b_bs1() { python -m benchmarks.generate --eval-data $D/wikitext-2/valid.txt --rows 8b_32k_bs1,8b_128k_bs1 --methods dense_engine --fused-decode --dense-block-kernel --result $R/generate_8b_bs1.json; }
run_int4_frozen() { need_model; need_prose; python -m benchmarks.int4_hybrid --parts ppl --eval-data $D/wikitext-2/valid.txt --smollm2-export /tmp/JF/runs/joint_long/export --smollm2-weights int4-g32 --calibration-data "$D/prose/*.txt.xz" --result $R/int4_hybrid_g32_frozen_base.json; }
run_int4_8b_bs1() { python -m benchmarks.int4_hybrid --parts 8b --rows 8b_32k_bs1,8b_128k_bs1 --methods dense_engine --result $R/int4_hybrid_8b_bs1.json; }
run_prefill() {
  python -m benchmarks.prefill_profile --model smollm2 --context 8144 --result $R/prefill_smollm2_8k.json
  methods=""; case "$GPU" in *H200*) ;; *) methods="--methods dense_engine gsm gsm_pytorch_pack";; esac  # HF's ran out of an H100
  python -m benchmarks.prefill_profile --model 8b --context 32768 $methods --result $R/prefill_8b_32k.json
}
run_decode_smol() { python -m benchmarks.decode_step_profile --model smollm2 --fused --context 6144 --steps 10 --result $R/decode_step_profile_smollm2_6k.json; }
run_scale_mlp() { python -m benchmarks.scale_8b --profile-steps 2 --checkpointing mlp --only dense_lora joint_lora --result $R/scale_8b_lora_mlp.json; }
run_scale_tf32() { python -m benchmarks.scale_8b --profile-steps 2 --checkpointing mlp --only joint_lora --set train.fp32_matmul=tf32 --result $R/scale_8b_joint_lora_tf32.json; }
run_overlap() {
  shapes="32768,1 131072,1"; case "$GPU" in *H200*) shapes="$shapes 32768,16";; esac
  for shape in $shapes; do IFS=, read ctx batch <<< "$shape"
    python -m benchmarks.decode_step_profile --fused --serial-selection --context $ctx --batch $batch --steps 10 --result $R/decode_overlap_${ctx}_$batch.json
  done
}
run_gputests() { timeout 480 python -m pytest -n 8 -p no:cacheprovider -q tests/test_asq_pack_kernel.py tests/test_prefill.py tests/test_prefill_cost.py tests/test_decode.py tests/test_own_block_attention.py tests/test_joint.py tests/test_tuning.py tests/test_generation.py tests/test_decode_fusion.py tests/test_cache_reuse.py tests/test_greedy_loop.py; }
run_scale_full() { python -m benchmarks.scale_8b --profile-steps 2 --only dense_full joint_full --result $R/scale_8b_full.json; }
run_asq_ab() { python -m benchmarks.asq_attention --shape llama3-8b --only flex_visible_tiles flex_visible_tiles_rows_guaranteed_safe dense_causal_sdpa_T_keys bound_flex_mask_reads_only_the_selection bound_flex_visible_tiles_without_a_mask --result $R/asq_attention_mask.json; }
run_decode_bs16() { python -m benchmarks.decode_step_profile --fused --dense-block-kernel --context 32768 --batch 16 --steps 10 --result $R/decode_step_profile_32k_bs16.json; }
for step in $STEPS; do
  echo "== $step $(date +%T)" >> $L; started=$(date +%s)
  run_$step > $R/$step.txt 2>&1; status=$?
  echo "   rc=$status $(( $(date +%s) - started )) s" >> $L
  tar czf /tmp/res.tmp.tgz -C /tmp res && mv /tmp/res.tmp.tgz /tmp/res.tar.gz
done
echo "== done $(date +%T)" >> $L
