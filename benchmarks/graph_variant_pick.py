"""Host cost of picking a step's graph variant (GraphVariants.label), which a server's host step
pays once per decode step before the replay (tuner.integrations.graph_variants): batch sizes
1, 64 and 256, the lengths as a CPU int32 tensor (as SGLang's seq_lens_cpu), a NumPy array and
a list, a step that picks a variant and one that keeps the base graph, and a batch padded up
to the captured size; and a step of a class whose record is FA3's wave_fit, whose cap the pick
computes from the lengths (batch 3 and 8 with 8 kv heads, batch 128 with one), on one batch of
lengths again and again and as a decode run's steps make them (each a token longer). With the
replay judge (tuner.integrations.replay_judge), what SGLang's host step adds once the step's
class has its verdict: the judge's tick, and its look-ups of the step's pick.

    python benchmarks/graph_variant_pick.py [--label NAME] [--out FILE]
"""

from __future__ import annotations

import torch
from common.host_cost import arguments, ns_per_call, report

CALLS = 20_000
REPEATS = 9
DECODING_STEPS = 4_000  # per repeat: a decode run's steps, each timed once


def _judged_step(judge, variants, batch, lengths):
    """SGLang's host step with the judge (tuner.integrations.sglang.load_batch_of_variant)."""
    judge.tick()
    pick = variants.pick(batch, lengths)
    return not judge.dropped(batch, pick) and judge.judging(batch, pick)


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    from tuner.integrations.graph_variants import GraphVariants, _WaveSteps
    from tuner.integrations.replay_judge import ReplayJudge

    variants = GraphVariants()
    results = {}
    for batch in (1, 64, 256):
        # a table as plan() leaves it: a label for each kv bucket up to 128k, dense or not
        variants._labels[batch] = {(1 << e, d): f"tuner-{e % 4 + 1}" for e in range(18) for d in (True, False)}
        lengths = torch.randint(1, 100_000, (batch,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        cases = {
            "cpu_int32_tensor": lambda b=batch, t=lengths: variants.label(b, t),
            "numpy_int32": lambda b=batch, a=lengths.numpy().copy(): variants.label(b, a),
            "list": lambda b=batch, x=lengths.tolist(): variants.label(b, x),
            "cpu_int32_tensor_padded": lambda b=batch, t=lengths: variants.label(b, t, raw_batch=max(1, b - 3)),
            "batch_without_variants": lambda b=batch + 1, t=lengths: variants.label(b, t),
            "cpu_int32_tensor_judged": lambda b=batch, t=lengths: _judged_step(judge, variants, b, t),
        }
        judge = ReplayJudge(8, 0.01, on_drop=lambda *a: None)
        judge.verdicts[(batch, variants.pick(batch, lengths))] = 0.95  # kept: as every later step finds it
        for name, fn in cases.items():
            fn()
            results[f"batch_{batch}_{name}"] = ns_per_call(fn, CALLS, REPEATS)
    for batch, kv_heads in ((3, 8), (8, 8), (128, 1)):
        # as plan() leaves a batch size whose record is wave_fit at every kv bucket
        shape = dict(num_kv_heads=kv_heads, q_per_kv=4, q_len=1, head_dim=128, table_keys=131072, sms=132)
        classes = frozenset((1 << e, d) for e in range(18) for d in (True, False))
        variants._labels[batch] = {}
        variants._waves[batch] = _WaveSteps(shape, classes, {132 // (batch * kv_heads): "tuner-1"})
        lengths = torch.randint(8000, 11000, (batch,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        fn = lambda b=batch, t=lengths: variants.label(b, t)  # noqa: E731
        fn()
        results[f"batch_{batch}_kv_heads_{kv_heads}_wave_fit_cpu_int32_tensor"] = ns_per_call(fn, CALLS, REPEATS)
        results[f"batch_{batch}_kv_heads_{kv_heads}_wave_fit_decoding"] = _decoding(variants, batch, lengths)
    report(args, "graph_variant_pick.py", {"calls": CALLS, "repeats": REPEATS, "decoding_steps": DECODING_STEPS,
                                           **results})


def _decoding(variants, batch: int, lengths: torch.Tensor) -> dict[str, float]:
    """The pick over a decode run's steps, each sequence a token longer at every step (the
    wave_fit model's results are kept per batch of kv blocks, which such steps cross now and
    then), none of them timed twice."""
    from tuner.ops import fa3_waves

    getattr(fa3_waves, "_caps_by_blocks", {}).clear()  # (a checkout before it kept none)
    steps = iter((lengths + torch.arange(DECODING_STEPS * REPEATS, dtype=torch.int32)[:, None]).unbind(0))
    return ns_per_call(lambda: variants.label(batch, next(steps)), DECODING_STEPS, REPEATS)


if __name__ == "__main__":
    main()
