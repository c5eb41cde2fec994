"""The head configurations issue 12's benchmarks run (DecodeShape fields besides batch and
kv_len): three with shipped tunings, two without (the issue's freshly swept keys)."""

LLAMA_8B_TP1 = dict(num_q_heads=32, num_kv_heads=8)
LLAMA_70B_TP8 = dict(num_q_heads=8, num_kv_heads=1)
QWEN_7B_TP1 = dict(num_q_heads=28, num_kv_heads=4)
HD256_SOFTCAP_WINDOW = dict(num_q_heads=16, num_kv_heads=8, head_dim=256, softcap=50.0, window=(4095, 0))
# bfloat16: FA3 (sgl-kernel 0.4.5) refuses float16 sinks ("sinks must have dtype bfloat16")
HD64_SINKS_WINDOW = dict(num_q_heads=64, num_kv_heads=8, head_dim=64, sinks=True, window=(127, 0))
