"""Accelerator check: the fused Pallas kernel's gate, attention throughput, a training step.

    python -m bench.accelerator_check            # one GPU, under 8 minutes
    python -m bench.accelerator_check --smoke    # CPU, tiny sizes, ~1.5 min

Four sections, each row appended to the markdown table (`--out`, default
results/accelerator_check/DEVICE-DATE.md) as soon as it is measured, so a run cut short
still leaves its table:

a. gate: the Pallas kernel against the float32 reference (matmul precision "highest", so
   no TF32) at shapes that cover the unmasked loop (no documents), documents and padding,
   lengths that are not a multiple of the block, SSMax inside and outside the prior, GQA,
   negative theta_beta, a query offset, no prior, the prior table, a steep learned prior
   under SSMax deep in a KV cache; values in float32 and bfloat16, and the gradients
   of q, k, v, the prior parameters and the SSMax scales (thresholds: GATE_THRESHOLDS).
   If any check fails the run prints FAIL, skips every row that runs the kernel and exits
   with status 1.
b. throughput: forward and forward+backward TFLOP/s of each attention variant at 16k, 32k
   and 128k tokens, the most important first (batch 1, 16 heads, head dim 128, bf16,
   causal). FLOPs are the causal matmul
   FLOPs: forward 2 * B * H * T^2 * D (QK^T and PV over the lower triangle), backward 2.5x
   that (five matmuls, QK^T recomputed), so forward+backward 3.5x; the prior's elementwise
   work is not counted.
c. training: the step time and tokens/s of a bf16 training step of the l12_512 preset
   (passkey data, batch reduced to fit one device) with each attention implementation.
d. autotune (only with `--sections autotune`): the GGD forward at the first length over
   GPU block sizes, warps and stages (AUTOTUNE_GRID), fastest first, ending with the
   GPU_DEFAULTS entry to copy into bam_jax/kernels/gpu.py.

Modules: report (the markdown table and the deadline), settings, gate, throughput, training
(on bench/train_bench.py's step timing), autotune, cli. The float32 matmul rate (precision
"highest", `bam_jax.provenance.matmul_gflops`) is measured first; every timed row shows
its ratio to it. A global deadline (`--deadline-s`) skips rows that would pass it and
stops the run at it.
"""
