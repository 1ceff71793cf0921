"""Post-training quantization: rules (path regex -> scheme), calibration, GPTQ, SmoothQuant."""
