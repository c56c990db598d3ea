#!/usr/bin/env bash
# One device call's worth of GPU work each (a call is limited to 10 minutes):
#   kernel        the checked GEMM's tests on the GPU (all of them: the small-shape ones, which compare
#                 the paths against each other, run on CUDA there too), the accumulation-noise
#                 diagnostic, one model's GEMM speed
#   evidence      the evidence inside the launch against a second launch in a protected HF step
#                 (results/evidence_shadow.json), and the clean alarms of full checking (results/alarms/)
#   diagnose      where a checked GEMM's time goes (results/gemm_diagnose.json) and a host profile of launches
#   evidence-parts  the evidence inside the launch beside it with parts switched off or changed
#                 (results/gemm_diagnose_evidence_parts.json), then the checked GEMM's
#                 GPU tests (about 3 minutes) and the inline-against-second-launch shadow of a real step
#   checksums     the output's integer checksums against the row sums of its values in fp32 (the kernel
#                 before), in the training step's checked launch (results/gemm_diagnose_checksums.json), then
#                 the GEMM's GPU tests (replays bit-exact across the shape table, the sides' CUDA-core slices too)
#   col-parts     where a wgrad's column check costs: its row+col launch with the column side, the column
#                 partials, their squares or the column blocks' finish left out
#                 (gemm_diagnose.py --rowcol-parts → results/gemm_diagnose_col_parts.json)
#   side-cuda     the row side in the K loop on the CUDA cores against the slices after it and the in-loop MMA
#                 (gemm_diagnose.py --side-groups 1,loop,cuda,cuda_rc → results/gemm_diagnose_side_cuda.json)
#   side-groups   the reference side's slices taken by every g-th tile, g = 1, 2, 4, 8
#                 (benchmarks/gemm_diagnose.py --side-groups → results/gemm_diagnose_side_groups.json)
#   side-in-loop  the row side inside the K loop against its slices after it, on the GQA k/v shapes and q/o
#                 (gemm_diagnose.py --side-groups 1,loop → results/gemm_diagnose_side_in_loop.json), then the
#                 GEMM's GPU tests (replays bit-exact across the shape table, the in-loop side too)
#   tune          choose the configuration per shape class (benchmarks/gemm_tune.py → results/gemm_tune.json)
#   gemm-1/gemm-2 the GEMM record (benchmarks/results/gemm.json), models split over two calls
#   sensitivity   detection at r = 1 and false alarms at three shape classes (results/sensitivity.json)
#   attention     the attention kernels' GPU tests and speed against SDPA, the warp-specialized forward beside
#                 the other (results/attention.json)
#   gluon-attention        a checked attention forward in Gluon (the side MMA in P·V's group) against cuDNN
#                          and our Triton forward (results/gluon_attention_probe_pipeline_{off,on}.json)
#   attention-diagnose     the attention kernels' time per kernel and with parts of the checks removed
#                          (results/attention_diagnose.json)
#   attention-tune         the attention kernels' blocks (results/attention_tune.json)
#   attention-sensitivity  detection per stage and check, false alarms (results/sensitivity_attention_triton.json)
#   attention-routed       protected models with attention on the Triton kernels: the attention and hot-path GPU
#                          tests (no host sync per call), and the HF step unprotected / 1% budget / full
#   tests-1       the GPU-marked tests of models and the hot path (attention routing, the clean-run matrix,
#                 fingerprints, hot path): about 6 minutes
#   quick         for a call of under 4 minutes (a session with little device time left): the GPU-marked
#                 tests of the module swaps, the hot path and the Triton Linear, stopped at 170 s
#   tests-2       the GPU-marked tests of the kernels (GEMM, Linear, attention; about 4 minutes), then the
#                 GEMM's small-shape tests on CUDA
#   gluon-probe   a ping-pong warp-specialized GEMM in Gluon: three tiles; the row check's partials, then its side too
#                 (results/gluon_pingpong_probe.json)
#   gluon-tile-check  the same GEMM with a tile that checks itself on the CUDA cores (results/gluon_tile_check_probe.json)
#   state-sensors the state sensors' GPU tests, then their cost in the 1.1B step (results/state_sensors.json)
#   tile-check    the tile-local row check probe (results/gemm_tile_check.json)
#   study [ARGS]  the paired healthy-vs-suspect study: HF Llama at the 1.1B widths, 2 layers, bf16, deterministic
#                 kernels, three modes, controls and a bit sweep (benchmarks/study_gpu.py ARGS; $out/study.tgz,
#                 for docs/study/gpu/)
#   campaign      the fault campaign on the H200 in bf16 (600 trials; results/campaign_gpu.json, plots in $out)
#   screen        `aegis screen`'s GPU tests, then the healthy and faulty screens of the H200
#                 (results/screen.json)
#   cutlass-probe CUTLASS's CuTe DSL Hopper GEMM beside ours (results/cutlass_probe.json). Needs, carried in
#                 the ignored folder .dsl/: dsl.tar.xz (nvidia-cutlass-dsl[cu13] unpacked for the device's
#                 Python, with its deps) and CUTLASS's dense_gemm_persistent.py example (CuTe DSL, Hopper)
#   budget-costs  the activation sums' speed (results/activation_sums.json), the GPU tests of this change (the
#                 compiled fused optimizer step, Mixtral's eager experts, the sums), and the HF step unprotected
#                 and at a 1% budget with the cost model it planned with ($out/e2e_budget_costs.json)
#   e2e-evidence  the HF step's full checking with the evidence inside the GEMM launch and in a second
#                 launch, each against its unprotected step ($out/e2e_inline.json, $out/e2e_second_launch.json)
#   e2e-eager | e2e-compiled | e2e-own   the end-to-end step record (results/e2e_step.json); the
#                 later ones resume the file the device holds, which is the tree's (a call's outputs
#                 do not stay on the device): `e2e` runs eager and compiled in one call
# Writes logs and results under $OUT (the device's output folder) or ./gpu-out.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
out="${OUT:-gpu-out}"
mkdir -p "$out"
results=benchmarks/results/e2e_step.json
# e2e_eager|e2e_compiled SECONDS: one part of the step record, within that time
e2e_eager() {
  timeout "$1" python benchmarks/e2e_step.py --workloads hf --modes eager --profile "$out" --out "$results" \
    2>&1 | grep -v Warn | tee "$out/e2e_eager.log"
}
e2e_compiled() {
  timeout "$1" python benchmarks/e2e_step.py --workloads hf --modes compiled --resume --out "$results" \
    2>&1 | grep -v Warn | tee "$out/e2e_compiled.log"
}
case "${1:-tests-1}" in
  kernel)
    timeout 300 python -m pytest -q tests/test_triton_gemm.py tests/test_triton_linear.py -p no:cacheprovider \
      2>&1 | tee "$out/kernel_tests.log" | tail -30
    timeout 120 python benchmarks/noise_gpu.py 2>&1 | tee "$out/noise_gpu.log"
    timeout 150 python benchmarks/gemm.py --models tinyllama-1.1b --tokens 8192 --out "$out/gemm_tinyllama.json" \
      2>&1 | tee "$out/gemm_tinyllama.log" | tail -25 ;;
  evidence)
    timeout 200 python benchmarks/evidence_shadow.py --out benchmarks/results/evidence_shadow.json 2>&1 | grep -v Warn \
      | tee "$out/evidence_shadow.log" | tail -12
    timeout 330 python benchmarks/e2e_step.py --workloads hf --configs unprotected,full --rounds 1 --steps 5 \
      --out benchmarks/results/alarms/e2e_full.json 2>&1 | grep -v Warn | tee "$out/e2e_full.log" | tail -5
    cp benchmarks/results/evidence_shadow.json benchmarks/results/alarms/e2e_full.json "$out/" ;;
  diagnose)
    timeout 200 python benchmarks/gemm_diagnose.py --out "$out/gemm_diagnose.json" 2>&1 | tee "$out/gemm_diagnose.log" | tail -12
    timeout 60 python benchmarks/gemm_diagnose.py --profile-host > "$out/gemm_host_profile.txt" 2>&1 ;;
  evidence-parts)
    timeout 200 python benchmarks/gemm_diagnose.py --evidence-parts --layers gate_up,q_o,8b.o \
      --parts no_finish,tickets_only,chunk_16 \
      --out benchmarks/results/gemm_diagnose_evidence_parts.json 2>&1 | grep -v "Warn\|^kernel regs" \
      | tee "$out/gemm_diagnose_evidence_parts.log" | tail -8
    cp benchmarks/results/gemm_diagnose_evidence_parts.json "$out/"
    timeout 200 python -m pytest -q -m gpu tests/test_triton_gemm.py -p no:cacheprovider 2>&1 \
      | tee "$out/gemm_gpu_tests.log" | tail -5
    timeout 200 python benchmarks/evidence_shadow.py --out benchmarks/results/evidence_shadow.json 2>&1 | grep -v Warn \
      | tee "$out/evidence_shadow.log" | tail -6
    cp benchmarks/results/evidence_shadow.json "$out/" ;;
  checksums)
    timeout 200 python benchmarks/gemm_diagnose.py --evidence-parts --layers gate_up,q_o,8b.o,kv --parts out_sums_values \
      --out benchmarks/results/gemm_diagnose_checksums.json 2>&1 | grep -v "Warn\|^kernel regs" \
      | tee "$out/gemm_diagnose_checksums.log" | tail -10
    cp benchmarks/results/gemm_diagnose_checksums.json "$out/" 2>/dev/null
    timeout 330 python -m pytest -q -m gpu tests/test_triton_gemm.py tests/test_triton_linear.py -p no:cacheprovider 2>&1 \
      | tee "$out/gemm_gpu_tests.log" | tail -8 ;;
  col-parts)
    timeout 150 python benchmarks/gemm_diagnose.py --rowcol-parts --layers gate_up,q_o,8b.o \
      --out benchmarks/results/gemm_diagnose_col_parts.json 2>&1 | grep -v "Warn\|^kernel regs" \
      | tee "$out/gemm_diagnose_col_parts.log" | tail -8
    cp benchmarks/results/gemm_diagnose_col_parts.json "$out/" 2>/dev/null ;;
  side-cuda)
    timeout 240 python benchmarks/gemm_diagnose.py --layers gate_up,q_o,8b.o,kv --side-groups 1,loop,cuda,cuda_rc \
      --out benchmarks/results/gemm_diagnose_side_cuda.json 2>&1 | grep -v "Warn\|^kernel regs" \
      | tee "$out/gemm_diagnose_side_cuda.log" | tail -8
    cp benchmarks/results/gemm_diagnose_side_cuda.json "$out/" 2>/dev/null ;;
  side-groups)
    timeout 400 python benchmarks/gemm_diagnose.py --layers gate_up,q_o,kv,8b.o --side-groups 1,2,4,8 \
      --out benchmarks/results/gemm_diagnose_side_groups.json 2>&1 | grep -v "Warn\|^kernel regs" \
      | tee "$out/gemm_diagnose_side_groups.log" | tail -12
    cp benchmarks/results/gemm_diagnose_side_groups.json "$out/" 2>/dev/null ;;
  side-in-loop)
    timeout 240 python benchmarks/gemm_diagnose.py --layers kv,7b.kv,70b.kv,q_o --side-groups 1,loop \
      --out benchmarks/results/gemm_diagnose_side_in_loop.json 2>&1 | grep -v "Warn\|^kernel regs" \
      | tee "$out/gemm_diagnose_side_in_loop.log" | tail -12
    cp benchmarks/results/gemm_diagnose_side_in_loop.json "$out/" 2>/dev/null
    timeout 300 python -m pytest -q -m gpu tests/test_triton_gemm.py -p no:cacheprovider 2>&1 \
      | tee "$out/gemm_gpu_tests.log" | tail -8 ;;
  tune)
    timeout 570 python benchmarks/gemm_tune.py --out "$out/gemm_tune.json" 2>&1 | tee "$out/gemm_tune.log" ;;
  gemm-1)
    timeout 570 python benchmarks/gemm.py --models tinyllama-1.1b,llama3-8b --out benchmarks/results/gemm.json \
      2>&1 | tee "$out/gemm_1.log"
    cp benchmarks/results/gemm.json "$out/" ;;
  gemm-2)
    timeout 570 python benchmarks/gemm.py --resume --models llama3-70b-tp8,qwen2.5-7b,qwen2.5-1.5b \
      --out benchmarks/results/gemm.json 2>&1 | tee "$out/gemm_2.log"
    cp benchmarks/results/gemm.json "$out/" ;;
  sensitivity)
    timeout 570 python benchmarks/sensitivity.py --out "$out/sensitivity.json" 2>&1 | tee "$out/sensitivity.log" ;;
  attention)  # the tests took 208 s before the D = 256 and padding-mask cases (about twice as many now)
    timeout 450 python -m pytest -q -m gpu tests/test_triton_attention.py tests/test_attention.py -p no:cacheprovider \
      --durations=8 2>&1 | tee "$out/attention_tests.log" | tail -20
    timeout 110 python benchmarks/attention.py --out benchmarks/results/attention.json 2>&1 | tee "$out/attention.log"
    cp benchmarks/results/attention.json "$out/" 2>/dev/null ;;
  gluon-attention)  # the pipelined variants in a process of their own: a hang there keeps the others' record
    for form in off on; do
      timeout 200 python benchmarks/gluon_attention_probe.py --pipeline $form \
        --out benchmarks/results/gluon_attention_probe_pipeline_$form.json 2>&1 | grep -v "Warn\|^ *$" \
        | tee "$out/gluon_attention_probe_$form.log" | cut -c1-600 | tail -12
      cp benchmarks/results/gluon_attention_probe_pipeline_$form.json "$out/" 2>/dev/null
    done ;;
  attention-diagnose)
    timeout 400 python benchmarks/attention_diagnose.py --out benchmarks/results/attention_diagnose.json 2>&1 \
      | grep -v Warn | tee "$out/attention_diagnose.log" | tail -20
    cp benchmarks/results/attention_diagnose.json "$out/" ;;
  attention-tune)
    timeout 330 python benchmarks/attention.py --tune --out benchmarks/results/attention_tune.json 2>&1 \
      | tee "$out/attention_tune.log" | tail -30
    cp benchmarks/results/attention_tune.json "$out/" 2>/dev/null ;;
  attention-sensitivity)
    timeout 330 python benchmarks/sensitivity_attention.py --kernels triton --heads 8 --seq 512 --dim 128 \
      --clean-calls 2000 --out benchmarks/results/sensitivity_attention_triton.json 2>&1 | tail -3
    cp benchmarks/results/sensitivity_attention_triton.json "$out/" 2>/dev/null ;;
  attention-routed)
    timeout 240 python -m pytest -q -m gpu tests/test_attention.py tests/test_hot_path.py -k "attention or synchronize" \
      -p no:cacheprovider 2>&1 | tee "$out/attention_routed_tests.log" | tail -15
    timeout 330 python benchmarks/e2e_step.py --workloads hf --configs unprotected,budget_1pct,full --rounds 3 \
      --triton-attention --out "$out/e2e_attention.json" 2>&1 | grep -v Warn | tee "$out/e2e_attention.log" ;;
  e2e-evidence)
    for evidence in inline second-launch; do
      timeout 270 python benchmarks/e2e_step.py --workloads hf --modes eager --configs unprotected,full --rounds 3 \
        --evidence "$evidence" --out "$out/e2e_${evidence/-/_}.json" 2>&1 | grep -v Warn \
        | tee "$out/e2e_${evidence/-/_}.log" | tail -4
    done ;;
  budget-costs)
    timeout 60 python benchmarks/activation_sums.py --out benchmarks/results/activation_sums.json 2>&1 \
      | tee "$out/activation_sums.log" | tail -8
    cp benchmarks/results/activation_sums.json "$out/" 2>/dev/null
    timeout 200 python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider \
      "tests/test_hot_path.py::test_on_cuda_a_compiled_fused_optimizer_step_keeps_the_gate_and_blames_no_healthy_device" \
      "tests/test_matrices.py::test_on_cuda_grouped_experts_are_named_and_handed_back_and_eager_experts_are_checked" \
      "tests/test_triton_linear.py::test_the_wgrads_activation_sums_match_fp64_sums_bit_for_bit_on_every_rerun" \
      2>&1 | grep -v DEBUG | tee "$out/budget_costs_tests.log" | tail -8
    timeout 300 python benchmarks/e2e_step.py --workloads hf --modes eager --configs unprotected,budget_1pct --rounds 3 \
      --out "$out/e2e_budget_costs.json" 2>&1 | grep -v Warn | tee "$out/e2e_budget_costs.log" | tail -12 ;;
  tests-1)
    timeout 570 python -m pytest -q -m gpu tests/ -p no:cacheprovider --durations=10 \
      --ignore=tests/test_triton_gemm.py --ignore=tests/test_triton_linear.py --ignore=tests/test_triton_attention.py \
      2>&1 | tee "$out/gpu_tests_1.log" | tail -40 ;;
  quick)
    timeout 170 python -m pytest -q -m gpu tests/test_matrices.py tests/test_torch_modules.py tests/test_hot_path.py \
      tests/test_triton_linear.py -p no:cacheprovider --durations=8 2>&1 | tee "$out/gpu_quick.log" | tail -30 ;;
  tests-2)
    timeout 400 python -m pytest -q -m gpu tests/test_triton_gemm.py tests/test_triton_linear.py \
      tests/test_triton_attention.py -p no:cacheprovider --durations=10 2>&1 | tee "$out/gpu_tests_2.log" | tail -40
    timeout 150 python -m pytest -q -m "not gpu" tests/test_triton_gemm.py -p no:cacheprovider 2>&1 \
      | tee "$out/gpu_small_shape_tests.log" | tail -15 ;;
  gluon-probe)
    timeout 400 python benchmarks/gluon_pingpong_probe.py --out benchmarks/results/gluon_pingpong_probe.json 2>&1 \
      | grep -v Warn | tee "$out/gluon_pingpong_probe.log" | tail -12
    cp benchmarks/results/gluon_pingpong_probe.json "$out/" ;;
  gluon-tile-check)
    timeout 400 python benchmarks/gluon_tile_check_probe.py --tokens 2048,8192,16384 \
      --out benchmarks/results/gluon_tile_check_probe.json 2>&1 | grep -v "Warn\|leaked\|nanobind\|skipped" \
      | tee "$out/gluon_tile_check_probe.log" | tail -12
    cp benchmarks/results/gluon_tile_check_probe.json "$out/" ;;
  state-sensors)
    timeout 120 python -m pytest -q -m gpu tests/test_state_sensors.py -p no:cacheprovider 2>&1 \
      | tee "$out/state_sensors_tests.log" | tail -5
    timeout 420 python benchmarks/state_sensors.py --out benchmarks/results/state_sensors.json 2>&1 | grep -v Warn \
      | tee "$out/state_sensors.log" | tail -12
    cp benchmarks/results/state_sensors.json "$out/" 2>/dev/null ;;
  study)  # tarred: the device's copy-back leaves out files past a count, and the study writes 11
    timeout 560 python benchmarks/study_gpu.py --out "$out/study" "${@:2}" 2>&1 | grep -v Warn | tee "$out/study.log" \
      | cut -c1-300 | tail -14
    tar czf "$out/study.tgz" -C "$out" study && rm -rf "$out/study" ;;
  campaign)
    timeout 560 python benchmarks/campaign.py --device cuda --trials 600 --plots "$out/campaign" 2>&1 \
      | grep -v Warn | tee "$out/campaign.log" | tail -8
    cp benchmarks/results/campaign_gpu.json "$out/" 2>/dev/null ;;
  screen)
    timeout 240 python -m pytest -q -m gpu tests/test_screen.py -p no:cacheprovider 2>&1 \
      | tee "$out/screen_tests.log" | tail -5
    timeout 330 python benchmarks/screen.py --out benchmarks/results/screen.json 2>&1 | grep -v Warn \
      | tee "$out/screen.log" | tail -15
    cp benchmarks/results/screen.json "$out/" 2>/dev/null ;;
  tile-check)
    timeout 400 python benchmarks/gemm_tile_check.py --out benchmarks/results/gemm_tile_check.json 2>&1 \
      | tee "$out/gemm_tile_check.log" | tail -25
    cp benchmarks/results/gemm_tile_check.json "$out/" ;;
  cutlass-probe)
    mkdir -p /tmp/site && tar xf .dsl/dsl.tar.xz -C /tmp/site || exit 1
    export PYTHONPATH="/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PYTHONPATH"
    timeout 560 python benchmarks/cutlass_probe.py --example .dsl/dense_gemm_persistent.py \
      --out benchmarks/results/cutlass_probe.json 2>&1 | grep -v Warn | tee "$out/cutlass_probe.log" | tail -25
    cp benchmarks/results/cutlass_probe.json "$out/" ;;
  e2e)
    e2e_eager 200 | tail -12
    e2e_compiled 370 | tail -16
    cp "$results" "$out/" ;;
  e2e-eager)
    e2e_eager 560
    cp "$results" "$out/" ;;
  e2e-compiled)
    e2e_compiled 560
    cp "$results" "$out/" ;;
  e2e-own)
    timeout 560 python benchmarks/e2e_step.py --workloads own --modes eager,compiled --resume --out "$results" \
      2>&1 | grep -v Warn | tee "$out/e2e_own.log"
    cp "$results" "$out/" ;;
  *) echo "usage: $0 budget-costs|gluon-attention|attention-diagnose|side-in-loop|kernel|evidence|diagnose|evidence-parts|side-groups|tune|attention|attention-tune|attention-sensitivity|attention-routed|gemm-1|gemm-2|sensitivity|tests-1|tests-2|tile-check|screen|gluon-probe|gluon-tile-check|cutlass-probe|state-sensors|e2e|e2e-eager|e2e-compiled|e2e-own" >&2; exit 2 ;;
esac
