"""The device report: what jaxsys measures on one accelerator in a few minutes.

`report.run_report(sizes.FULL)` runs, in order and each within its share of the time
budget: kernel correctness against the reference (`checks`), a large bf16 matmul
(`train.matmul_run`), attention fwd+bwd against cuDNN and XLA (`attention`), quantized
matmuls against a bf16 dot (`qmatmul`), the runner's train step for two presets
(`train`), and KV-cache decoding (`generation`). `sizes.SMOKE` runs the same code at tiny
sizes on CPU. `experiments/device_report.py` is the binary.
"""
