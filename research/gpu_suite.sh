#!/usr/bin/env bash
# The GPU test suite and the attention benchmark in one go; every output lands in OUTDIR.
# The tests run on 10 pytest-xdist workers (installed on the GPU image) to spread the kernel compiles (16 CPU cores).
#   research/gpu_suite.sh OUTDIR [tests|tests-emulation|tests-rest|bench|train|profile|agreement|cost|narrow|gqa|masked|hf|
#                                 decode|atomic-dq|breakdown|heads|host|host-profile|padded|d40|sweep]...
#   (default: tests bench)
# train: the compiled training step's throughput, sdpa against our kernels, six interleaved rounds
# profile: a profile of the compiled training step
# agreement: how often the emulated presets give the reference's bits (research/emulation_agreement.py)
# cost: SFA's and the statistics' cost and SFA vs FA2 over 7 interleaved rounds, from a graph (and eager at T = 1024)
# narrow: the dose-response study's numerics (e8m4 nearest, toward zero, stochastic) as a ratio to the `paper` kernel
# gqa: GQA against MHA at the same FLOPs, its group summed in the dK/dV programs or afterwards;
# masked: windows and padding against FlexAttention and SDPA;
# hf: a transformers Llama's compiled training step, sdpa against ours
# decode: one decoding step's attention (the decoding kernel, paged, the flash kernels, SDPA) at five cache sizes
# atomic-dq: SFA's backward with dQ added by the dK/dV programs against the default and cuDNN, at the benchmark's
#   shapes; breakdown: the per-kernel device time of both against cuDNN's (research/kernel_breakdown.py)
# heads: head dims 80, 96 (padded to 128), 160 (to 256) and 256 against 128, ours and SDPA's
#   (docs/speed-predictions.md)
# host: the eager call's host and device time at (16, 12, 1024, 64), this tree's and, with HOST_BEFORE=DIR (a
#   `git archive` of another commit's stableflash/, carried), that tree's in the same call (research/eager_host.py)
# host-profile: where that call's host time goes: per part of the eager path (--sections) and cProfile (--profile)
# padded: the kernel tests of head dims padded inside the kernels alone (a quick check after changing them)
# d40: D = 40 (strides Triton cannot prove divisible by 16) against D = 64, from a graph, this tree's kernels and, with
#   BEFORE=DIR (a `git archive` of another commit's stableflash/, carried), that tree's in the same call
# sweep: the random differential sweep of the public calls against a dense fp64 softmax (research/attention_sweep.py),
#   SWEEP_S seconds (default 240) of fresh cases from SWEEP_SEED (default 0)
# The test parts also write each failure as it happens to OUTDIR/<part>-failures.jsonl (tests/conftest.py): a call's
# time limit can cut pytest before its report.
# On the lent GPU the copy's git metadata can be stale: pass STABLEFLASH_COMMIT=<hash> so the JSON names the tree.
set -u
out=${1:?usage: research/gpu_suite.sh OUTDIR [tests|bench|train]...}
shift
parts=${*:-tests bench}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$out/gpu.csv" 2>&1
status=0
for part in $parts; do
  case $part in
    tests) STABLEFLASH_FAILURES="$out/gpu-tests-failures.jsonl" python3 -m pytest -n 10 -m gpu -q -rs -p no:cacheprovider tests/ --junitxml "$out/gpu-tests.xml" \
             2>&1 | tee "$out/gpu-tests.log" | tail -25; status=$((status | PIPESTATUS[0])) ;;
    # the suite in two halves of ~5 minutes each on 16 workers, for calls of at most 10 minutes; -v names each
    # result as it comes (a call cut short still says which passed), --timeout a hung test
    tests-emulation|tests-rest)
      select="emulation or rounding or narrow or stochastic"
      [ "$part" = tests-rest ] && select="not ($select)"
      STABLEFLASH_FAILURES="$out/$part-failures.jsonl" python3 -m pytest -n 16 -m gpu -v --tb=short -rfE --timeout 300 \
        -p no:cacheprovider tests/ -k "$select" \
        --junitxml "$out/$part.xml" > "$out/$part.log" 2>&1; status=$((status | $?))
      grep -E "(PASSED|FAILED|ERROR) tests" "$out/$part.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' \
        | cut -d' ' -f1 | sort | uniq -c; tail -3 "$out/$part.log" ;;
    bench) python3 benchmarks/attention.py --out "$out/attention-bench-h200.json" 2>&1 | tee "$out/attention-bench.log" ;;
    # six interleaved rounds, judged on the median of each round's ratio: one round spreads about 2% (the first round
    # compiles, ~150 s; later ones ~7 s each)
    train) s=sdpa,triton-fa2,triton-fa2-sfa
           python3 benchmarks/train_throughput.py --compile --steps 150 --warmup 10 --out "$out/train" \
             --settings $s,$s,$s,$s,$s,$s 2>&1 | grep -v Warning | tail -22 | tee "$out/train-throughput.log"
           cp "$out/train/train-throughput-compiled.json" "$out/" 2>/dev/null; rm -rf "$out/train" ;;
    profile) python3 benchmarks/train_throughput.py --compile --profile --steps 10 --warmup 8 --out "$out/prof" \
               --settings sdpa,triton-fa2,triton-fa2-sfa 2>&1 | tail -12 | tee "$out/train-profile.log"
             cp "$out/prof/train-profile-compiled.json" "$out/" 2>/dev/null; rm -rf "$out/prof" ;;
    agreement) python3 research/emulation_agreement.py --out "$out/emulation-agreement-h200.json" 2>&1 | grep -v Warning \
                 | tee "$out/emulation-agreement.log" ;;
    cost) python3 benchmarks/feature_cost.py --rounds 7 --out "$out/feature-cost-h200.json" 2>&1 | grep -v Warning \
            | tee "$out/feature-cost.log" ;;
    narrow) python3 benchmarks/attention.py --modes fwdbwd_graph --out "$out/attention-narrow-h200.json" \
              --impls stableflash-paper,stableflash-pv-e8m4,stableflash-pv-e8m4-tz,stableflash-pv-e8m4-sr 2>&1 \
              | grep -v Warning | tee "$out/attention-narrow.log" ;;
    gqa) python3 benchmarks/attention.py --modes fwdbwd,fwdbwd_graph --out "$out/attention-gqa-h200.json" \
           --impls stableflash,stableflash-gqa,stableflash-gqa-shares,stableflash-sfa,stableflash-sfa-gqa,stableflash-sfa-gqa-shares \
           2>&1 | grep -v Warning \
           | tee "$out/attention-gqa.log" ;;
    masked) python3 benchmarks/masked_attention.py --out "$out/masked-attention.json" 2>&1 | grep -v Warning \
              | tee "$out/masked-attention.log" ;;
    hf) python3 benchmarks/transformers_step.py --out "$out/transformers-step.json" 2>&1 | grep -v Warning \
          | tee "$out/transformers-step.log" ;;
    decode) python3 benchmarks/transformers_models.py --models none --out "$out/decode-attention.json" 2>&1 \
              | grep -v Warning | tee "$out/decode-attention.log" ;;
    atomic-dq) python3 benchmarks/attention.py --modes fwdbwd,fwdbwd_graph --out "$out/attention-atomic-dq.json" \
                 --impls stableflash,stableflash-atomic-dq,stableflash-sfa,stableflash-sfa-atomic-dq,sdpa-cudnn 2>&1 \
                 | grep -v Warning | tee "$out/attention-atomic-dq.log" ;;
    heads) python3 benchmarks/attention.py --impls stableflash,stableflash-sfa,sdpa-cudnn,sdpa-flash \
             --modes fwdbwd,fwdbwd_graph \
             --shapes "4,32,2048,80;4,32,2048,96;4,32,2048,128;4,16,2048,160;4,16,2048,256" \
             --out "$out/attention-heads.json" 2>&1 | grep -v Warning | tee "$out/attention-heads.log" ;;
    breakdown) python3 research/kernel_breakdown.py --out "$out/kernel-breakdown.json" 2>&1 | grep -v Warning \
                 | tee "$out/kernel-breakdown.log" ;;
    host) python3 research/eager_host.py --out "$out/eager-host.json" 2>&1 | grep -v Warning | tee "$out/eager-host.log"
          if [ -n "${HOST_BEFORE:-}" ]; then
            PYTHONPATH=$HOST_BEFORE python3 research/eager_host.py --out "$out/eager-host-before.json" 2>&1 \
              | grep -v Warning | tee "$out/eager-host-before.log"
          fi ;;
    host-profile) { python3 research/eager_host.py --out "$out/unused.json" --sections 200
                    python3 research/eager_host.py --out "$out/unused.json" --profile 300; } 2>&1 | grep -v Warning \
                    | tee "$out/eager-host-profile.log" ;;
    padded) STABLEFLASH_FAILURES="$out/padded-failures.jsonl" python3 -m pytest -n 14 -m gpu -v --tb=short -rfE --timeout 300 -p no:cacheprovider \
              tests/attention/test_triton.py -k "padded or padding_inside or zero_padded or stride8" > "$out/padded-tests.log" 2>&1
            status=$((status | $?)); tail -3 "$out/padded-tests.log" ;;
    d40) d40() { python3 benchmarks/attention.py --impls stableflash,stableflash-sfa,sdpa-cudnn --modes fwdbwd_graph \
                   --shapes "4,32,2048,40;4,32,2048,64" --out "$1" 2>&1 | grep -v Warning | tee -a "$out/attention-d40.log"; }
         d40 "$out/attention-d40.json"
         [ -n "${BEFORE:-}" ] && PYTHONPATH=$BEFORE:$PYTHONPATH d40 "$out/attention-d40-before.json" ;;
    sweep) python3 research/attention_sweep.py --device cuda --budget-s "${SWEEP_S:-240}" --seed "${SWEEP_SEED:-0}" \
             --cases 1000000 --out "$out/attention-sweep.json" 2>&1 | grep -v Warning | tail -40 \
             | tee "$out/attention-sweep.log"; status=$((status | PIPESTATUS[0])) ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
exit $status
