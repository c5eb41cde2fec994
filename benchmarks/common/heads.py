"""The head configurations issue 12's benchmarks run (DecodeShape fields besides batch and
kv_len): three with shipped tunings, two without (the issue's freshly swept keys)."""

LLAMA_8B_TP1 = dict(num_q_heads=32, num_kv_heads=8)
LLAMA_70B_TP8 = dict(num_q_heads=8, num_kv_heads=1)
QWEN_7B_TP1 = dict(num_q_heads=28, num_kv_heads=4)
HD256_SOFTCAP_WINDOW = dict(num_q_heads=16, num_kv_heads=8, head_dim=256, softcap=50.0, window=(4095, 0))
# bfloat16: FA3 (sgl-kernel 0.4.5) refuses float16 sinks ("sinks must have dtype bfloat16")
HD64_SINKS_WINDOW = dict(num_q_heads=64, num_kv_heads=8, head_dim=64, sinks=True, window=(127, 0))


def parse_spec(spec: str) -> dict:
    """A head configuration written as the sweep CLI's options are: "Q/KV" with optional
    words "hdD", "windowW", "softcapC", "sinks" (e.g. "48/8", "64/8 hd64 sinks window127")."""
    words = spec.split()
    if not words or words[0].count("/") != 1:
        raise ValueError(f"a head configuration is Q/KV [hdD] [windowW] [softcapC] [sinks], got {spec!r}")
    q, kv = (int(x) for x in words[0].split("/"))
    out: dict = dict(num_q_heads=q, num_kv_heads=kv)
    for word in words[1:]:
        if word == "sinks":
            out["sinks"] = True
        elif word.startswith("hd"):
            out["head_dim"] = int(word[2:])
        elif word.startswith("window"):
            out["window"] = (int(word[6:]), 0)
        elif word.startswith("softcap"):
            out["softcap"] = float(word[7:])
        else:
            raise ValueError(f"unknown word {word!r} in head configuration {spec!r}")
    return out
