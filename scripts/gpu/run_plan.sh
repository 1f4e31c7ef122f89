#!/usr/bin/env bash
# Runs named items of docs/BENCHMARKS.md's "Left for the next GPU session" list on the lent GPU
# machine, each under its own time limit, logs in $OUT, a summary on stdout, and the MLX kernel
# cache packed into $OUT/kernels.tgz at the end (copy it to .gpu/k/ for the next window).
#
#   device call two (after .gpu/a/stash.sh), carry [".gpu/b", ".gpu/c", ".gpu/k"]:
#     bash scripts/gpu/run_plan.sh 8b-first 8b-long kernel-32k
#
# An item may end in @nographs or @graphs (MLX's CUDA graphs off or on for that item), or in #N
# (the item again, its log named ITEM-N).
# Items run in the order given; the budget (default 560 s, the call's limit less a margin) is
# shared: an item gets what is left. Set PLAN_BUDGET_S to change it.
set -u
source .gpu/c/env.sh || exit 3
root=$PWD
OUT=${OUT:-/tmp/plan-out}
mkdir -p "$OUT"
budget=${PLAN_BUDGET_S:-560}
# The device copy's git metadata can be stale: name the sources by their hash instead.
src=$(find runtime scripts -name '*.py' | sort | xargs cat | sha256sum | cut -c1-16)
echo "sources sha256 $src, items: $*"

run() {  # name, seconds at most, command... (the item's @tag, if any, names its log too)
  local name=$1$tag limit=$2; shift 2
  local left=$(( budget - SECONDS - 15 ))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then echo "== $name: skipped, the budget is spent"; return; fi
  echo "== $name (at most ${limit} s)"
  local started=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   rc $?, $(( SECONDS - started )) s"
  grep -E "^\| |^8b |^1b |^summed|^rows |^ +start |^ *[0-9]+ \||^total|stacked products|warmed up in|pools and attention|loaded the model|our CUDA kernels|WARNING|passed|failed|match|loaded:|delta-net|recurrent model|pads_recurrent|kernel_for|DeltaCall" \
    "$OUT/$name.log" | grep -v "^| *-" | head -40
}

for item in "$@"; do
  # ITEM@nographs / ITEM@graphs: the same item with MLX's CUDA graphs off / on (MLX_USE_CUDA_GRAPHS)
  tag=; unset MLX_USE_CUDA_GRAPHS
  case $item in
    *@nographs) item=${item%@*}; tag=-nographs; export MLX_USE_CUDA_GRAPHS=0 ;;
    *@graphs) item=${item%@*}; tag=-graphs; export MLX_USE_CUDA_GRAPHS=1 ;;
  esac
  case $item in  # ITEM#N: the same item again, its log named ITEM-N
    *#[0-9]*) tag=$tag-${item#*#}; item=${item%#*} ;;
  esac
  tag=$tag${fuse_tag:-}${cubin_tag:-}${pad_tag:-}${tail_tag:-}${rope_tag:-}${loop_tag:-}${win_tag:-}${sink_tag:-}${cpu_tag:-}${hyb_tag:-}${tree_tag:-}${settle_tag:-}${res_tag:-}  # after fuse-prefill / no-fuse-prefill: -fused / -apart; after tail-xN: -tailxN; after rope-off / rope-on: -rope-off / -rope-on
  case $item in
    kernel-ab) run "$item" 300 python3 scripts/paged_kernel_ab.py ;;
    gemv-ab) run "$item" 150 python3 scripts/gemv_ab.py ;;
    long-prefill) run "$item" 300 python3 scripts/long_prefill_cost.py --shape llama-8b --context 32768 --chunk 2048 ;;
    pytest-kernel) run "$item" 300 python3 -m pytest -q tests/test_paged_kernel_cuda.py ;;
    pytest-kernel-mma) run "$item" 200 python3 -m pytest -q tests/test_paged_kernel_cuda.py -k mma ;;
    use-best-loop)  # on this device copy only: the A/B's winners as LOOP (unsplit launches) and
                    # SPLIT_LOOP (split ones); neither if a pytest-kernel log failed
      for pair in LOOP:unsplit SPLIT_LOOP:split; do
        var=${pair%:*}
        loop=$(python3 scripts/gpu/pick_loop.py "$OUT/kernel-ab.log" --launches "${pair#*:}" 2>>"$OUT/pick-loop.log")
        if cat "$OUT"/pytest-kernel*.log 2>/dev/null | grep -qE "failed|error"; then loop=; fi
        [ -n "$loop" ] && sed -i "s/^$var = \".*\"/$var = \"$loop\"/" runtime/worker/paths/paged_attention.py
      done
      echo "== use-best-loop: $(tr '\n' ';' < "$OUT/pick-loop.log" 2>/dev/null) $(grep -E '^(SPLIT_)?LOOP =' runtime/worker/paths/paged_attention.py | tr '\n' ' ')" ;;
    cubin-on)  # on this device copy only: the items after it launch our kernels as CUBINs kept on disk
      sed -i 's/^PRECOMPILE = False/PRECOMPILE = True/' runtime/worker/paths/cuda/cubin_kernels.py; cubin_tag=-cubin
      echo "== cubin-on: $(grep -E '^PRECOMPILE =' runtime/worker/paths/cuda/cubin_kernels.py)" ;;
    fuse-prefill)  # on this device copy only: the items after it run prefill and decode as one forward
      sed -i 's/^FUSE_PREFILL = False/FUSE_PREFILL = True/' runtime/worker/engine.py; fuse_tag=-fused
      echo "== fuse-prefill: $(grep -E '^FUSE_PREFILL =' runtime/worker/engine.py)" ;;
    fuse-2048)  # on this device copy only: the items after it fuse steps of up to 2,048 prefill tokens with
                # their decode rows (FUSE_MAX_TOKENS), not 512: steps of more ran 2-4 separate forwards, each waited for
      sed -i 's/^FUSE_MAX_TOKENS = 512$/FUSE_MAX_TOKENS = 2048/' runtime/worker/engine.py; fuse_tag=-fuse2048
      echo "== fuse-2048: $(grep -E '^FUSE_MAX_TOKENS =' runtime/worker/engine.py)" ;;
    no-fused-residual)  # on this device copy only: the items after it keep MLX's two kernels for each residual add and the
                        # RMSNorm after it (before session 32's fused_residual): a suspect for the 1B's slow prefill forwards
      sed -i "s/^    if group is None:  # a sharded model's blocks add partial sums/    if False:  # a sharded model's blocks add partial sums/" runtime/worker/loader.py; res_tag=-unfused-residual
      echo "== no-fused-residual: $(grep -E "^    if (False|group is None):  # a sharded model's blocks add" runtime/worker/loader.py)" ;;
    residual-all-rows)  # on this device copy only: the items after it run the fused residual kernel at any row count
                        # (before session 44), prefill forwards included, not at most MAX_KERNEL_ROWS
      sed -i 's/^MAX_KERNEL_ROWS = 256$/MAX_KERNEL_ROWS = 1 << 30/' runtime/worker/paths/cuda/add_rms_norm.py; res_tag=-residual-all-rows
      echo "== residual-all-rows: $(grep -E '^MAX_KERNEL_ROWS =' runtime/worker/paths/cuda/add_rms_norm.py)" ;;
    no-settle)  # on this device copy only: the items after it evaluate pool writes right after a read-back, without
                # waiting for MLX's completion thread to release the step's buffers (before session 44: a race)
      sed -i 's/^        self.cuda = on_gpu and mx.cuda.is_available()$/        self.cuda = False/' runtime/worker/engine.py; settle_tag=-unsettled
      echo "== no-settle: $(grep -E '^        self.cuda = ' runtime/worker/engine.py)" ;;
    no-narrow-tail)  # on this device copy only: the items after it flush the decode tail (and wait for the step before)
                     # whenever rows leave the batch, as before session 44, not only at prefill steps and full tails
      sed -i 's/^NARROW_TAIL = True$/NARROW_TAIL = False/' runtime/worker/paths/attention_paths.py; tail_tag=-flush-on-leave
      sed -i 's/^NARROW_BATCH = True$/NARROW_BATCH = False/' runtime/worker/pools/aux_pool.py  # (a hybrid's resident states too)
      echo "== no-narrow-tail: $(grep -hE '^NARROW_(TAIL|BATCH) =' runtime/worker/paths/attention_paths.py runtime/worker/pools/aux_pool.py | tr '\n' ' ')" ;;
    fuse-late)  # on this device copy only: the items after it build a fused step's forward after the previous step's
                # read-back (in prepare), as before session 44, not while that step runs
      sed -i 's/^BUILD_FUSED_EARLY = True\b/BUILD_FUSED_EARLY = False/' runtime/worker/engine.py; fuse_tag=${fuse_tag:-}-late
      echo "== fuse-late: $(grep -E '^BUILD_FUSED_EARLY =' runtime/worker/engine.py)" ;;
    no-mixed-starts)  # on this device copy only: the items after it run a hybrid's prefill chunks of different
                      # starts as separate forwards again (before session 42), for an A/B on one machine
      sed -i 's/        self.mixed_starts = aux_pool is not None and /        self.mixed_starts = False and aux_pool is not None and /' runtime/worker/engine.py; hyb_tag=${hyb_tag:-}-bystart
      echo "== no-mixed-starts: $(grep -E 'self.mixed_starts = ' runtime/worker/engine.py)" ;;
    s28-tree)  # the items after it run session 28's sources (8ee2341, packed by `git archive 8ee2341 runtime
               # scripts` into .gpu/d/s28-tree.tgz; carry .gpu/d): a same-machine baseline for the mixed runs
      tgz=.gpu/d/s28-tree.tgz; [ -f $tgz ] || tgz=/root/stash/s28-tree.tgz
      mkdir -p /tmp/s28-tree && tar -xzf $tgz -C /tmp/s28-tree && cd /tmp/s28-tree || exit 5
      export PYTHONPATH=/root/site:/root/site2:/tmp/s28-tree; tree_tag=-s28
      echo "== s28-tree: $(pwd), sources sha256 $(find runtime scripts -name '*.py' | sort | xargs cat | sha256sum | cut -c1-16)" ;;
    main-tree)  # back to this checkout's sources after s28-tree (an A/B in both orders in one call)
      cd "$root" && export PYTHONPATH=/root/site:/root/site2:$root; tree_tag=
      echo "== main-tree: $(pwd)" ;;
    unpadded)  # on this device copy only: the items after it run with worker.pad_shapes = "off" (mlx-lm's shapes)
      sed -i 's/self.padded_shapes = on_gpu if pad_shapes is None/self.padded_shapes = False if pad_shapes is None/' runtime/worker/engine.py; pad_tag=-unpadded
      echo "== unpadded: $(grep -E 'self.padded_shapes = ' runtime/worker/engine.py)" ;;
    windowed-gathered)  # on this device copy only: the items after it decode sliding-window models (Gemma 3) by the
                        # pool gather or the row cache, as before the kernel read windows (window_view)
      sed -i 's/windows_fit = all(w is None or w >= tail_capacity(TAIL_STEPS) for w in layout.windows)/windows_fit = not layout.windowed/' runtime/worker/paths/attention_paths.py; win_tag=-gathered
      echo "== windowed-gathered: $(grep -E 'windows_fit = ' runtime/worker/paths/attention_paths.py)" ;;
    delta-ops)  # on this device copy only: the items after it run delta-net layers by mlx-lm's ops, not our
                # kernel (do the 4 copy_v<float, float> a delta-net layer and step go with the kernel?)
      sed -i 's/    kernel = GatedDeltaKernel(on_cuda and uses)/    kernel = GatedDeltaKernel(False)/' runtime/worker/paths/cuda/gated_delta_check.py; hyb_tag=${hyb_tag:-}-ops
      echo "== delta-ops: $(grep -E 'kernel = GatedDeltaKernel' runtime/worker/paths/cuda/gated_delta_check.py)" ;;
    hybrid-rows)  # on this device copy only: the items after it decode hybrid models (Qwen3-Next) by the compiled
                  # row-cache step instead of the paged kernel
      sed -i 's/        paged = (routed and layout.routed and not layout.shares_kv and windows_fit/        paged = (routed and layout.routed and not layout.has_aux and not layout.shares_kv and windows_fit/' runtime/worker/paths/attention_paths.py; hyb_tag=-rows
      echo "== hybrid-rows: $(grep -E 'paged = \(' runtime/worker/paths/attention_paths.py)" ;;
    pytest-sinks) run "$item" 200 python3 -m pytest -q tests/test_sinks_cuda.py tests/test_paged_attention.py -k "sink or start_up" ;;
    cpu-streams)  # on this device copy only: the items after it let a GPU's compiled row step split attention over
                  # CPU streams, as before session 33 (parallel_attention.streams_on)
      sed -i 's/    return streams if on_cpu else 1/    return streams/' runtime/worker/paths/rows/parallel_attention.py; cpu_tag=-cpu-streams
      echo "== cpu-streams: $(grep -E '^    return streams' runtime/worker/paths/rows/parallel_attention.py)" ;;
    path-diff) run "$item" 240 python3 scripts/gpu/path_diff.py --arch gpt_oss --window 64 ;;
    path-diff-repeat) run "$item" 240 python3 scripts/gpu/path_diff.py --arch gpt_oss --window 64 --modes kernel,kernel,kernel-alone,kernel-alone ;;
    path-diff-dense) run "$item" 240 python3 scripts/gpu/path_diff.py --arch gpt_oss --window 64 --experts 2 ;;
    pytest-windowed-cuda) run "$item" 200 python3 -m pytest -q tests/test_window_view_cuda.py ;;
    sinks-gathered)  # on this device copy only: the items after it keep models with attention sinks (gpt-oss) off the
                     # paged kernel, as before its sink variant
      sed -i 's/        paged = (routed and layout.routed and not layout.shares_kv and windows_fit/        paged = (routed and layout.routed and not layout.sinks and not layout.shares_kv and windows_fit/' runtime/worker/paths/attention_paths.py; sink_tag=-gathered
      echo "== sinks-gathered: $(grep -E 'paged = \(' runtime/worker/paths/attention_paths.py)" ;;
    pytest-windowed) run "$item" 300 python3 -m pytest -q tests/test_window_view_cuda.py tests/test_window_view.py tests/test_windowed_families_exact.py tests/test_sliding_window_exact.py tests/test_gemma2_exact.py ;;
    gpt-oss-paired) run "$item" 300 python3 -m runtime.bench --synthetic gpt-oss-20b-8e --workloads paired --pairs 3 --json "$OUT/$item$tag.json" ;;
    gpt-oss-sweep) run "$item" 300 python3 -m runtime.bench --synthetic gpt-oss-20b-8e --workloads sweep --concurrency 16,64 --json "$OUT/$item$tag.json" ;;
    mla-paired) run "$item" 300 python3 -m runtime.bench --synthetic moonlight-16b-8e --workloads paired --pairs 3 --json "$OUT/$item$tag.json" ;;
    mla-sweep) run "$item" 300 python3 -m runtime.bench --synthetic moonlight-16b-8e --workloads sweep --concurrency 16,64 --json "$OUT/$item$tag.json" ;;
    qn-paired) run "$item" 300 python3 -m runtime.bench --synthetic qwen3-next-24l-dense --workloads paired --pairs 3 --json "$OUT/$item$tag.json" ;;
    qn-sweep) run "$item" 300 python3 -m runtime.bench --synthetic qwen3-next-24l-dense --workloads sweep --concurrency 16,64 --json "$OUT/$item$tag.json" ;;
    pytest-gated-delta) run "$item" 200 python3 -m pytest -q tests/test_gated_delta_kernel.py ;;
    pytest-hybrid) run "$item" 200 python3 -m pytest -q tests/test_aux_state.py tests/test_hybrid_kernel_path.py -k "resident or steady or qwen3_next or qwen3_5 or falcon_h1 or jamba" ;;
    profile-mla) run "$item" 200 python3 scripts/profile_decode.py --shape moonlight-16b-8e --batch 1,16 --context 256 --steps 32 --modes mlx,engine-overlap --kernels ;;
    hybrid-checks) run "$item" 120 python3 scripts/gpu/hybrid_checks.py --shape qwen3-next-24l-dense ;;
    qn-mixed-rt) run "$item" 300 python3 -m runtime.bench --synthetic qwen3-next-24l-dense --workloads mixed --mixed-rate 10 --mixed-runtime-only --mixed-requests 150 --mixed-prefix-requests 32 --json "$OUT/$item$tag.json" ;;
    qn-mixed-rt-trace) RUNTIME_WORKER_TRACE="$OUT/qn-mixed-worker-trace$tag" run "$item" 300 python3 -m runtime.bench --synthetic qwen3-next-24l-dense --workloads mixed --mixed-rate 10 --mixed-runtime-only --mixed-requests 150 --mixed-prefix-requests 32 --json "$OUT/$item$tag.json" ;;
    qn-mixed-rt-long-user) run "$item" 300 python3 -m runtime.bench --synthetic qwen3-next-24l-dense --workloads mixed --mixed-rate 10 --mixed-runtime-only --mixed-requests 150 --mixed-prefix-requests 32 --mixed-prefix-suffix 100,300 --json "$OUT/$item$tag.json" ;;
    qn-mixed) run "$item" 400 python3 -m runtime.bench --synthetic qwen3-next-24l-dense --workloads mixed --mixed-rate 10 --json "$OUT/$item$tag.json" ;;
    mla-sweep-trace) RUNTIME_WORKER_TRACE="$OUT/mla-sweep-worker-trace$tag" run "$item" 300 python3 -m runtime.bench --synthetic moonlight-16b-8e --workloads sweep --concurrency 16 --json "$OUT/$item$tag.json" ;;
    profile-qn) run "$item" 200 python3 scripts/profile_decode.py --shape qwen3-next-24l-dense --batch 1,16 --context 256 --steps 32 --modes mlx,engine-overlap --kernels ;;
    graph-diff)  # the primitives of one decode step, ours against mlx-lm's, eager and compiled (host-bound one-row steps)
      run "$item" 200 bash -c 'for shape in qwen3-next-24l-dense moonlight-16b-8e; do for mode in "" --compiled; do python3 scripts/graph_diff.py --shape $shape $mode | head -30; done; done' ;;
    encode-cost)  # host time per primitive kind (build, submit), to weigh graph-diff's counts
      run "$item" 150 python3 scripts/encode_cost.py --count 200 ;;
    qn-copies)  # which layer kind the one-row step's copy_v<float, float> come from: three mixes of delta-net
                # and attention layers (2+2, 3+1, 6+2); copies = a x delta-net + b x attention + c
      run "$item" 240 bash -c 'for mix in "4 2" "4 4" "8 4"; do set -- $mix; python3 scripts/profile_decode.py --shape qwen3-next-24l-dense --batch 1 --context 256 --steps 16 --modes mlx,engine-overlap --kernels --set num_hidden_layers=$1 --set full_attention_interval=$2; done' ;;
    gemma-sweep-trace) RUNTIME_WORKER_TRACE="$OUT/gemma-sweep-worker-trace$tag" run "$item" 200 python3 -m runtime.bench --synthetic gemma3-1b --workloads sweep --concurrency 16 --json "$OUT/$item$tag.json" ;;
    gemma-mixed-rt-short) run "$item" 200 python3 -m runtime.bench --synthetic gemma3-1b --workloads mixed --mixed-runtime-only --mixed-requests 150 --mixed-prefix-requests 32 --json "$OUT/$item$tag.json" ;;
    no-fuse-prefill)  # and back
      sed -i 's/^FUSE_PREFILL = True/FUSE_PREFILL = False/' runtime/worker/engine.py; fuse_tag=-apart
      echo "== no-fuse-prefill: $(grep -E '^FUSE_PREFILL =' runtime/worker/engine.py)" ;;
    tail-x[0-9]*)  # on this device copy only: the items after it hold N times TAIL_STEPS in a small batch's
                   # decode tail (FEW_ROWS_FACTOR; tail-x1: every batch flushes every TAIL_STEPS steps, as before session 26)
      sed -i "s/^FEW_ROWS_FACTOR = [0-9]*/FEW_ROWS_FACTOR = ${item#tail-x}/" runtime/worker/paths/cuda/decode_tail.py; tail_tag=-tail${item#tail-}
      echo "== $item: $(grep -E '^FEW_ROWS_FACTOR =' runtime/worker/paths/cuda/decode_tail.py)" ;;
    rope-off|rope-on)  # on this device copy only: the items after it rotate with MLX's rope kernels (off) or in
                       # the paged kernel (on, the default: engine.KERNEL_ROPE)
      value=$([ "$item" = rope-off ] && echo False || echo True)
      sed -i "s/^KERNEL_ROPE = .*/KERNEL_ROPE = $value/" runtime/worker/engine.py; rope_tag=-$item
      echo "== $item: $(grep -E '^KERNEL_ROPE =' runtime/worker/engine.py)" ;;
    pytest-rope) run "$item" 300 python3 -m pytest -q tests/test_paged_kernel_cuda.py -k rotating ;;
    kernel-layout)  # the pool read slot-major (its layout) against head-major (KV heads, slots, D), contiguous and
                    # scattered slots, 1 and 8 rows at 32k: would a head-major pool close the gap to cuDNN?
      run "$item" 200 bash -c "for hm in '' --head-major; do for sc in '' '--scatter --slots 600000'; do
                                 python3 scripts/kernel_bench.py \$hm \$sc --rows 1,8 --context 32768 --calls 20; done; done" ;;
    split-loop-*|loop-*)  # on this device copy only: the items after it use this loop for split launches (split-loop-X,
                          # paged_attention.SPLIT_LOOP) or unsplit ones (loop-X, LOOP)
      var=$([ "${item#split-}" != "$item" ] && echo SPLIT_LOOP || echo LOOP); value=${item#split-}; value=${value#loop-}
      sed -i "s/^$var = \".*\"/$var = \"$value\"/" runtime/worker/paths/paged_attention.py; loop_tag=-$item
      echo "== $item: $(grep -E "^$var =" runtime/worker/paths/paged_attention.py)" ;;
    kernel-gpu) run "$item" 120 bash -c "python3 scripts/kernel_bench.py --rows 1,8,64 --context 32768 --calls 20 &&
                                          python3 scripts/kernel_bench.py --rows 1,8 --context 32768 --calls 20 --scatter &&
                                          python3 scripts/kernel_bench.py --rows 1,64 --context 2048 --calls 20 &&
                                          python3 scripts/kernel_bench.py --rows 1 --context 32768 --calls 20 --sweep 8,16,32,64,128x4,8,16" ;;
    kernel-scale)  # one row: does the kernel's time grow with the context from a fixed cost, or per position?
                   # and does a big pool with scattered slots cost more (the service's pool, not the bench's)?
      run "$item" 150 bash -c "for c in 8192 16384 32768 65536 131072; do python3 scripts/kernel_bench.py --rows 1 --context \$c --calls 20; done &&
                               python3 scripts/kernel_bench.py --rows 1 --context 32768 --slots 1048576 --scatter --calls 20" ;;
    kernel-regs)  # the split kernels' loop and register cap, one row x 32k (the base, the worker's own, first)
      run "$item" 200 bash -c "for v in mma_ahead:0 mma:0 mma:168 mma:128 mma_ahead:168 mma:96; do
                                 python3 scripts/kernel_bench.py --loop \${v%:*} --split-registers \${v#*:} --rows 1,1,8 --context 32768 --calls 30; done" ;;
    use-best-regs)  # on this device copy only: kernel-regs's winner as SPLIT_LOOP and SPLIT_MAX_REGISTERS
      best=$(python3 scripts/gpu/pick_regs.py "$OUT/kernel-regs.log" 2>>"$OUT/pick-regs.log")
      if [ -n "$best" ]; then
        sed -i "s/^SPLIT_LOOP = \".*\"/SPLIT_LOOP = \"${best% *}\"/; s/^SPLIT_MAX_REGISTERS = .*/SPLIT_MAX_REGISTERS = ${best#* }/" \
          runtime/worker/paths/paged_attention.py
      fi
      echo "== use-best-regs: $(tr '\n' ';' < "$OUT/pick-regs.log" 2>/dev/null) $(grep -E '^SPLIT_(LOOP|MAX_REGISTERS) =' runtime/worker/paths/paged_attention.py | tr '\n' ' ')" ;;
    kernel-gpu-mma) run "$item" 150 bash -c "for loop in mma mma_ahead; do
                                                python3 scripts/kernel_bench.py --loop \$loop --rows 1,8,64 --context 32768 --calls 20 &&
                                                python3 scripts/kernel_bench.py --loop \$loop --rows 1,64 --context 2048 --calls 20; done" ;;
    kernel-ncu) run "$item" 150 ncu --clock-control none --kernel-name regex:paged -c 1 --section SpeedOfLight \
                  --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
                  python3 scripts/kernel_bench.py --rows 1 --context 32768 --no-trace --calls 2 ;;
    imports) run "$item" 60 bash -c "python3 -X importtime -c 'import mlx.core, runtime.worker.loader, runtime.worker.engine' 2>&1 | sort -t'|' -k2 -n | tail -30; python3 -c 'import sys, time; t = time.perf_counter(); import mlx.core; a = time.perf_counter(); import runtime.worker.loader; print(\"mlx.core %.2f s, loader %.2f s, torch imported: %s\" % (a - t, time.perf_counter() - a, \"torch\" in sys.modules))'" ;;
    1b-paired) run "$item" 200 python3 -m runtime.bench --synthetic llama-1b --workloads paired --pairs 5 --json "$OUT/$item$tag.json" ;;
    1b-paired-short) run "$item" 200 python3 -m runtime.bench --synthetic llama-1b --workloads paired --pairs 5 --prompt-len 128 --gen-len 100 --json "$OUT/$item$tag.json" ;;
    1b-paired-trace) RUNTIME_WORKER_TRACE="$OUT/1b-paired-worker-trace$tag" run "$item" 200 python3 -m runtime.bench --synthetic llama-1b --workloads paired --pairs 3 --json "$OUT/$item$tag.json" ;;
    profile-8b-64) run "$item" 200 python3 scripts/profile_decode.py --shape llama-8b --batch 32,64 --context 1024 --steps 64 --modes mlx,engine,engine-overlap ;;
    profile-1b-1) run "$item" 150 python3 scripts/profile_decode.py --shape llama-1b --batch 1 --context 256 --steps 128 --modes mlx,engine-fused,engine-overlap --kernels ;;
    profile-8b-32k) run "$item" 240 python3 scripts/profile_decode.py --shape llama-8b --batch 1 --context 32768 --steps 32 --modes mlx,engine-overlap-fused --kernels ;;
    kernel-32k) run "$item" 120 python3 scripts/profile_decode.py --shape llama-8b --kernel 1,8 --context 32768 --modes "" ;;
    8b-first) run "$item" 300 python3 -m runtime.bench --synthetic llama-8b --workloads first --pairs 1 --json "$OUT/$item$tag.json" ;;
    8b-first-user) run "$item" 400 python3 -m runtime.bench --synthetic llama-8b --workloads first --pairs 2 --service-defaults --json "$OUT/$item$tag.json" ;;
    8b-first-user-1) run "$item" 300 python3 -m runtime.bench --synthetic llama-8b --workloads first --pairs 1 --service-defaults --json "$OUT/$item$tag.json" ;;
    8b-long) run "$item" 300 python3 -m runtime.bench --synthetic llama-8b --workloads long --long-lens 32768 --json "$OUT/$item$tag.json" ;;
    8b-long-warm) run "$item" 400 python3 -m runtime.bench --synthetic llama-8b --workloads long --long-lens 32768 --long-warm --json "$OUT/$item$tag.json" ;;
    8b-long-trace) RUNTIME_WORKER_TRACE="$OUT/8b-long-worker-trace" run "$item" 300 python3 -m runtime.bench --synthetic llama-8b --workloads long --long-lens 32768 ;;
    8b-mixed) run "$item" 500 python3 -m runtime.bench --synthetic llama-8b --workloads mixed --mixed-rate 10 --json "$OUT/$item$tag.json" ;;
    8b-mixed-rt) run "$item" 300 python3 -m runtime.bench --synthetic llama-8b --workloads mixed --mixed-rate 10 --mixed-runtime-only --json "$OUT/$item$tag.json" ;;
    8b-mixed-rt-trace) RUNTIME_WORKER_TRACE="$OUT/8b-mixed-worker-trace$tag" run "$item" 300 python3 -m runtime.bench --synthetic llama-8b --workloads mixed --mixed-rate 10 --mixed-runtime-only --json "$OUT/$item$tag.json" ;;
    8b-4bit-sweep) run "$item" 400 python3 -m runtime.bench --synthetic llama-8b-4bit --workloads sweep --concurrency 64 --json "$OUT/$item$tag.json" ;;
    8b-sweep) run "$item" 400 python3 -m runtime.bench --synthetic llama-8b --workloads sweep --concurrency 128 --json "$OUT/$item$tag.json" ;;
    1b-sweep) run "$item" 300 python3 -m runtime.bench --synthetic llama-1b --workloads sweep --concurrency 64,256 --json "$OUT/$item$tag.json" ;;
    1b-mixed-rt-short) run "$item" 200 python3 -m runtime.bench --synthetic llama-1b --workloads mixed --mixed-runtime-only --mixed-requests 150 --mixed-prefix-requests 32 --json "$OUT/$item$tag.json" ;;
    1b-mixed-rt-trace) RUNTIME_WORKER_TRACE="$OUT/1b-mixed-worker-trace$tag" run "$item" 200 python3 -m runtime.bench --synthetic llama-1b --workloads mixed --mixed-runtime-only --json "$OUT/$item$tag.json" ;;
    1b-mixed) run "$item" 400 python3 -m runtime.bench --synthetic llama-1b --workloads mixed --json "$OUT/$item$tag.json" ;;
    1b-mixed-10|1b-mixed-20)  # at a rate mlx_lm.server survives (at 30/s its generation thread died, session 39)
      run "$item" 400 python3 -m runtime.bench --synthetic llama-1b --workloads mixed --mixed-rate "${item##*-}" --json "$OUT/$item$tag.json" ;;
    1b-mixed-c32|1b-mixed-20-c32)  # mlx_lm.server at its own default --decode-concurrency 32: at 128 it ran out of
                                   # device memory at 10, 20 and 30/s (session 40); at 32 it completed 10/s
      rate=30; [ "$item" = 1b-mixed-20-c32 ] && rate=20
      run "$item" 400 python3 -m runtime.bench --synthetic llama-1b --workloads mixed --mixed-rate $rate --mlx-server-concurrency 32 --json "$OUT/$item$tag.json" ;;
    gemma-sweep) run "$item" 300 python3 -m runtime.bench --synthetic gemma3-1b --workloads sweep --concurrency 16,64 --json "$OUT/$item$tag.json" ;;
    gemma-bisect) run "$item" 240 python3 scripts/gemma_bisect.py --shape gemma3-1b --prompt 256 --new 48 ;;
    gemma-paired-trace) RUNTIME_WORKER_TRACE="$OUT/gemma-paired-worker-trace$tag" run "$item" 240 python3 -m runtime.bench --synthetic gemma3-1b --workloads paired --pairs 2 --json "$OUT/$item$tag.json" ;;
    gemma-first-user) run "$item" 300 python3 -m runtime.bench --synthetic gemma3-1b --workloads first --pairs 2 --service-defaults --json "$OUT/$item$tag.json" ;;
    gemma-paired) run "$item" 240 python3 -m runtime.bench --synthetic gemma3-1b --workloads paired --pairs 3 --json "$OUT/$item$tag.json" ;;
    gemma-long) run "$item" 300 python3 -m runtime.bench --synthetic gemma3-1b --workloads long --long-lens 8192,32768 --json "$OUT/$item$tag.json" ;;
    1b-first) run "$item" 200 python3 -m runtime.bench --synthetic llama-1b --workloads first --pairs 3 --json "$OUT/$item$tag.json" ;;
    pytest-gpu) run "$item" 400 python3 -m pytest -q tests/test_paged_kernel_cuda.py tests/test_paged_attention.py tests/test_fused_projections.py tests/test_fused_residual.py tests/test_cubin_kernels_cuda.py ;;
    pytest-cubin) run "$item" 150 python3 -m pytest -q tests/test_cubin_kernels_cuda.py tests/test_cubin_kernels.py ;;
    pytest-residual-kernel) run "$item" 120 python3 -m pytest -q tests/test_fused_residual.py ;;
    pytest-residual) run "$item" 200 python3 -m pytest -q tests/test_fused_residual.py tests/test_service_exact.py ;;
    pytest-shapes)  # attention layers of several shapes, KV-shared layers (Gemma 4, Gemma 3n): token-exact on CUDA too
      run "$item" 400 python3 -m pytest -q tests/test_layer_shapes_exact.py tests/test_kv_read_back.py tests/test_kv_shared_paths.py ;;
    *) echo "== $item: unknown (residual-all-rows no-fused-residual no-settle no-narrow-tail fuse-late main-tree 1b-mixed-rt-trace fuse-2048 no-mixed-starts s28-tree pytest-gated-delta pytest-hybrid qn-mixed mla-sweep-trace profile-mla qn-paired qn-sweep profile-qn qn-copies graph-diff encode-cost qn-mixed-rt-long-user qn-mixed-rt-trace delta-ops mla-paired mla-sweep cpu-streams path-diff sinks-gathered gpt-oss-paired gpt-oss-sweep pytest-sinks gemma-sweep-trace windowed-gathered pytest-windowed pytest-windowed-cuda gemma-mixed-rt-short gemma-first-user 1b-paired-short unpadded 1b-mixed-rt-short pytest-cubin gemma-bisect gemma-paired-trace gemma-paired gemma-sweep cubin-on pytest-residual-kernel pytest-residual kernel-layout split-loop-LOOP loop-LOOP rope-off rope-on pytest-rope tail-xN kernel-scale kernel-ab gemv-ab long-prefill pytest-kernel pytest-kernel-mma use-best-loop fuse-prefill no-fuse-prefill kernel-gpu kernel-regs use-best-regs kernel-gpu-mma kernel-ncu imports 1b-mixed-10 1b-mixed-20 1b-mixed-c32 1b-mixed-20-c32 1b-paired 1b-paired-trace profile-8b-64 profile-1b-1 profile-8b-32k kernel-32k 8b-first 8b-long 8b-long-warm 8b-long-trace 8b-mixed 8b-mixed-rt 8b-mixed-rt-trace 8b-4bit-sweep 8b-sweep 1b-sweep 1b-mixed 1b-first pytest-gpu pytest-shapes)" ;;
  esac
done
if [ -d ~/.cache/runtime/mlx-kernels ]; then
  tar czf "$OUT/kernels.tgz" -C ~/.cache/runtime mlx-kernels && echo "kernel cache: $(du -h "$OUT/kernels.tgz" | cut -f1)"
fi
for trace in "$OUT"/*-worker-trace*; do
  [ -f "$trace" ] && { echo "== $trace"; head -32 "$trace"; }
done
