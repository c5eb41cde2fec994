"""A stand-in for the parts of SGLang 0.5.17 that benchmarks/sglang_e2e.py drives (bench_one_batch's
entry point, result file, load_model and its runner, the server arguments and the attention
backend registry), for testing the harness on the CPU."""
