"""CPU kernels and their tuning: the CPU's features, linear kernels, draft precision, load-time calibration."""
