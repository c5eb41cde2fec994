"""The Triton kernels of tuner's split-KV paged decode, which tuner.ops.triton_decode
launches (its docstring says what they compute): the even split's and the splits by length
or load's stage 1, the merge, and the helpers they share.

Never imported by name: triton_decode loads this file into a module of its own for each
mode, compiled and interpreted, with TRITON_INTERPRET set as wanted while it runs (Triton
reads it when @triton.jit decorates). The kernels call their helpers as module globals,
where both the compiler and the interpreter look for them, so the two sets never share one.
"""

import triton
import triton.language as tl


@triton.jit
def _split_plan(seq_len, q_len, row_block, left, right, num_splits, tokens_per_split,
                GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BY_TOKENS: tl.constexpr):
    # (elementwise: for one sequence's row block, or for vectors of them)
    # keys any row of this row block may see: [lo, hi). The window masks are compiled in
    # only where they can bite: left >= 0, or right >= 0 with several queries (a lone
    # query sits at the last position, so no key lies to its right)
    lo = seq_len * 0
    hi = seq_len
    if MASK_LEFT:  # the block's first query sees furthest left
        first_pos = seq_len - q_len + (row_block * BLOCK_M) // GROUP
        lo = tl.maximum(first_pos - left, 0)
    if MASK_RIGHT:  # and its last query furthest right
        last_pos = seq_len - q_len + tl.minimum((row_block * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        hi = tl.minimum(last_pos + right + 1, seq_len)
    span = tl.maximum(hi - lo, 0)
    # this sequence's split count: all num_splits, or one per tokens_per_split of its own
    # keys (at most num_splits), so a short sequence beside a long one splits less
    splits = span * 0 + num_splits
    if BY_TOKENS:
        splits = tl.minimum(tl.maximum((span + tokens_per_split - 1) // tokens_per_split, 1), num_splits)
    # each split whole BLOCK_N blocks; rounding may leave the last ones without keys:
    # `used` counts those that have some (one at least: it writes a keyless row's output)
    chunk = tl.maximum(((span + splits - 1) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N, BLOCK_N)
    used = tl.maximum((span + chunk - 1) // chunk, 1)
    return lo, hi, chunk, used


@triton.jit
def _attend(Q, K, V, PageTable,
            stride_qb, stride_qs, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            stride_tb, stride_tp,
            b, kvh, row_block, seq_len, q_len, start, end, scale, softcap, left, right,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, PAGE_SIZE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, F32_DOT: tl.constexpr):
    # attention of a row block's rows over the keys [start, end) of sequence b, BLOCK_N at a
    # time through the page table, online softmax: the unnormalised output, the running
    # max and the sum of weights, and which rows they are. Row r is query token r // GROUP
    # of q head kvh * GROUP + r % GROUP
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * GROUP
    qi = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    pos = seq_len - q_len + qi  # the queries are the last q_len tokens
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    q_ptrs = Q + b * stride_qb + qi[:, None] * stride_qs + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)

    # loop invariants, hoisted by hand (the interpreter does no hoisting)
    K_head = K + kvh * stride_kh
    V_head = V + kvh * stride_vh
    pages = PageTable + b * stride_tb
    k_cols = K_head + offs_d[:, None]
    k_mask = d_ok[:, None]
    v_rows = V_head + offs_dv[None, :]
    v_mask = dv_ok[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tok_ok = tok < end
        page = tl.load(pages + (tok // PAGE_SIZE) * stride_tp, mask=tok_ok, other=0)
        page = page.to(tl.int64)
        in_page = tok % PAGE_SIZE
        k_off = page * stride_kp + in_page * stride_ks
        v_off = page * stride_vp + in_page * stride_vs
        # K is loaded transposed, (D, N), ready for the dot
        k = tl.load(k_cols + k_off[None, :], mask=k_mask & tok_ok[None, :], other=0.0)
        if F32_DOT:  # full float32 products, not tf32
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale
        if HAS_SOFTCAP:
            # s * tanh(x / s), tanh written with exp (tl.math.tanh differs across versions)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0))
        # padded rows (row_ok false) hold q = 0: finite scores, never stored
        ok = tok_ok[None, :]
        if MASK_LEFT:
            ok = ok & (tok[None, :] >= pos[:, None] - left)
        if MASK_RIGHT:
            ok = ok & (tok[None, :] <= pos[:, None] + right)
        s = tl.where(ok, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen nothing yet keeps max -inf: subtract 0 instead (no NaN)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_rows + v_off[:, None], mask=v_mask & tok_ok[:, None], other=0.0)
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i, qi, head, row_ok


@triton.jit
def _store_partial(Part, Lse, stride_pb, stride_ps, stride_ph, stride_pk, stride_lb, stride_ls, stride_lh,
                   b, qi, head, split, rows_stored, acc, m_i, l_i,
                   HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    # one split's share, for the merge: normalised, its log-sum-exp beside it
    offs_dv = tl.arange(0, BLOCK_DV)
    part = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
    p_ptrs = (Part + b * stride_pb + qi[:, None] * stride_ps + head[:, None] * stride_ph
              + split * stride_pk + offs_dv[None, :])
    tl.store(p_ptrs, part, mask=rows_stored[:, None] & (offs_dv < HEAD_DIM_V)[None, :])
    tl.store(Lse + b * stride_lb + qi * stride_ls + head * stride_lh + split, lse, mask=rows_stored)


@triton.jit
def _store_output(Out, Sinks, stride_ob, stride_os, stride_oh, b, qi, head, row_ok, rows_stored, acc, m_i, l_i,
                  HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr):
    # a sequence's whole output, from one split: normalised with the sink, in q's dtype
    offs_dv = tl.arange(0, BLOCK_DV)
    if HAS_SINKS:
        sink = tl.load(Sinks + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        m_all = tl.maximum(m_i, sink)
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
        alpha = tl.exp(m_i - m_all)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp(sink - m_all)
    # l_i == 0 only when nothing was seen, and then acc == 0: output 0
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_ptrs = Out + b * stride_ob + qi[:, None] * stride_os + head[:, None] * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=rows_stored[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


@triton.jit
def _decode_split_kernel(
    Q, K, V, PageTable, SeqLens, Sinks, Part, Lse, Out,
    stride_qb, stride_qs, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_tb, stride_tp,
    stride_pb, stride_ps, stride_ph, stride_pk,
    stride_lb, stride_ls, stride_lh,
    stride_ob, stride_os, stride_oh,
    q_len, num_kv_heads, num_splits, scale, softcap, left, right,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    FINAL: tl.constexpr, F32_DOT: tl.constexpr,
):
    # The even split: a program per (sequence x kv head, row block, split), each split a
    # num_splits-th of its sequence's keys. Every split writes its share (an empty one
    # too, with weight 0), so the merge reads all num_splits without looking up lengths.
    # int64 index math throughout: no int32 overflow on large caches or batches (and the
    # interpreter skips its per-op int32 overflow checks, a large share of its run time)
    pid_bh = tl.program_id(0).to(tl.int64)
    row_block = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    seq_len = tl.load(SeqLens + b).to(tl.int64)
    lo, hi, chunk, _ = _split_plan(seq_len, q_len, row_block, left, right, num_splits, 0,
                                   GROUP, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, False)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi)  # past the keys: no iteration, weight 0
    acc, m_i, l_i, qi, head, row_ok = _attend(
        Q, K, V, PageTable, stride_qb, stride_qs, stride_qh, stride_kp, stride_ks, stride_kh,
        stride_vp, stride_vs, stride_vh, stride_tb, stride_tp, b, kvh, row_block, seq_len, q_len, start, end,
        scale, softcap, left, right, GROUP, HEAD_DIM, HEAD_DIM_V, PAGE_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, F32_DOT)
    if FINAL:
        _store_output(Out, Sinks, stride_ob, stride_os, stride_oh, b, qi, head, row_ok, row_ok, acc, m_i, l_i,
                      HEAD_DIM_V, BLOCK_DV, HAS_SINKS)
    else:
        _store_partial(Part, Lse, stride_pb, stride_ps, stride_ph, stride_pk, stride_lb, stride_ls, stride_lh,
                       b, qi, head, split, row_ok, acc, m_i, l_i, HEAD_DIM_V, BLOCK_DV)


# batch and the programs' count vary call to call: no compiled variant of each
@triton.jit(do_not_specialize=["batch", "num_programs"])
def _decode_by_length_kernel(
    Q, K, V, PageTable, SeqLens, Sinks, Part, Lse, Out,
    stride_qb, stride_qs, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_tb, stride_tp,
    stride_pb, stride_ps, stride_ph, stride_pk,
    stride_lb, stride_ls, stride_lh,
    stride_ob, stride_os, stride_oh,
    batch, q_len, num_kv_heads, num_splits, tokens_per_split, target_items, num_programs, scale, softcap,
    left, right, SplitSize,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    F32_DOT: tl.constexpr, ROW_BLOCKS: tl.constexpr, BLOCK_U: tl.constexpr, BY_LOAD: tl.constexpr,
):
    # Splits by length. The work is items: one split of one (sequence, row block) "unit"
    # for one kv head; each unit gets a split per tokens_per_split of its own keys (at
    # most num_splits). The items are numbered unit by unit, split by split, kv head by
    # kv head, and num_programs persistent programs take them in turn: only real work is
    # scheduled, however the lengths are mixed (a grid sized for the longest sequence
    # would start a program for every split of every sequence, most of them idle).
    pid = tl.program_id(0).to(tl.int64)
    units = tl.arange(0, BLOCK_U).to(tl.int64)
    unit_ok = units < batch * ROW_BLOCKS
    unit_lens = tl.load(SeqLens + units // ROW_BLOCKS, mask=unit_ok, other=0).to(tl.int64)
    if BY_LOAD:
        # the split size from this call's load: the keys every unit reads, over every kv
        # head, shared so that all items come to target_items at most (whole blocks, one at
        # least): each (unit, kv head) rounds up to one more item than its keys' share, so
        # those are set aside first, and where they alone reach the target every unit is
        # one split. A light batch is split finely, a heavy one not at all. Every program
        # computes the same size; the first leaves it for the merge. (At most 2^30: past
        # any sequence's keys, and the merge reads it as int32.)
        lo_u, hi_u, _, _ = _split_plan(unit_lens, q_len, units % ROW_BLOCKS, left, right, num_splits, 1,
                                       GROUP, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, True)
        keys = tl.sum(tl.where(unit_ok, tl.maximum(hi_u - lo_u, 0), 0), 0) * num_kv_heads
        shares = target_items - batch * ROW_BLOCKS * num_kv_heads
        tokens_per_split = tl.where(shares > 0, (keys + shares - 1) // tl.maximum(shares, 1), 1 << 30)
        tokens_per_split = tl.minimum(tl.maximum(tokens_per_split, BLOCK_N), 1 << 30)
        if pid == 0:
            tl.store(SplitSize, tokens_per_split.to(tl.int32))
    _, _, _, unit_used = _split_plan(unit_lens, q_len, units % ROW_BLOCKS, left, right, num_splits,
                                     tokens_per_split, GROUP, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, True)
    unit_used = tl.where(unit_ok, unit_used, 0)
    ends = tl.cumsum(unit_used, 0)  # a unit's splits are slots [ends - used, ends)
    total = tl.sum(unit_used, 0) * num_kv_heads
    for item in range(pid, total, num_programs):
        kvh = item % num_kv_heads
        slot = item // num_kv_heads
        unit = tl.sum((ends <= slot).to(tl.int64), 0)  # the unit holding this slot
        split = slot - tl.sum(tl.where(units == unit, ends - unit_used, 0), 0)
        b = unit // ROW_BLOCKS
        row_block = unit % ROW_BLOCKS
        seq_len = tl.load(SeqLens + b).to(tl.int64)
        lo, hi, chunk, used = _split_plan(seq_len, q_len, row_block, left, right, num_splits, tokens_per_split,
                                          GROUP, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, True)
        start = lo + split * chunk
        end = tl.minimum(start + chunk, hi)
        acc, m_i, l_i, qi, head, row_ok = _attend(
            Q, K, V, PageTable, stride_qb, stride_qs, stride_qh, stride_kp, stride_ks, stride_kh,
            stride_vp, stride_vs, stride_vh, stride_tb, stride_tp, b, kvh, row_block, seq_len, q_len, start, end,
            scale, softcap, left, right, GROUP, HEAD_DIM, HEAD_DIM_V, PAGE_SIZE, BLOCK_M, BLOCK_N, BLOCK_D,
            BLOCK_DV, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, F32_DOT)
        # a unit in one split writes its output here, and the merge passes over it. (A
        # scalar condition joins a mask through tl.where: the interpreter's `&` of a
        # boolean block and a scalar gives integers, which it refuses as a mask.)
        _store_partial(Part, Lse, stride_pb, stride_ps, stride_ph, stride_pk, stride_lb, stride_ls, stride_lh,
                       b, qi, head, split, tl.where(used > 1, row_ok, False), acc, m_i, l_i, HEAD_DIM_V, BLOCK_DV)
        _store_output(Out, Sinks, stride_ob, stride_os, stride_oh, b, qi, head, row_ok,
                      tl.where(used == 1, row_ok, False), acc, m_i, l_i, HEAD_DIM_V, BLOCK_DV, HAS_SINKS)


@triton.jit
def _decode_merge_kernel(
    Part, Lse, SeqLens, Sinks, Out, SplitSize,
    stride_pb, stride_ps, stride_ph, stride_pk,
    stride_lb, stride_ls, stride_lh,
    stride_ob, stride_os, stride_oh,
    q_len, num_q_heads, num_splits, tokens_per_split, left, right,
    GROUP: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BY_TOKENS: tl.constexpr,
    BY_LOAD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # one (sequence, query token, q head) each
    h = pid % num_q_heads
    qi = (pid // num_q_heads) % q_len
    b = pid // (num_q_heads * q_len)
    if BY_TOKENS:  # the splits stage 1 wrote for this row: its row block's plan, again
        seq_len = tl.load(SeqLens + b).to(tl.int64)
        row_block = (qi * GROUP + h % GROUP) // BLOCK_M
        if BY_LOAD:  # the size stage 1 computed from the call's load
            tokens_per_split = tl.load(SplitSize).to(tl.int64)
        _, _, _, used = _split_plan(seq_len, q_len, row_block, left, right, num_splits, tokens_per_split,
                                    GROUP, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, True)
    else:  # the even split writes all of them, and no length need be read first
        used = pid * 0 + num_splits
    if used > 1:  # one split: stage 1 wrote the output itself
        offs_s = tl.arange(0, BLOCK_S)
        offs_dv = tl.arange(0, BLOCK_DV)
        s_ok = offs_s < used  # only the splits written are read
        dv_ok = offs_dv < HEAD_DIM_V
        row_lse = Lse + b * stride_lb + qi * stride_ls + h * stride_lh
        row_part = Part + b * stride_pb + qi * stride_ps + h * stride_ph + offs_dv[None, :]

        lse = tl.load(row_lse + offs_s, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, 0)
        if HAS_SINKS:
            sink = tl.load(Sinks + h).to(tl.float32)
            m = tl.maximum(m, sink)
        m = tl.where(m == float("-inf"), 0.0, m)  # nothing seen anywhere: weights are all 0
        w = tl.exp(lse - m)
        denom = tl.sum(w, 0)
        if HAS_SINKS:
            denom = denom + tl.exp(sink - m)  # the sink attends to nothing: denominator only
        if MERGE_CHUNK >= BLOCK_S:  # every split's partial output in one load: one round trip
            part = tl.load(row_part + offs_s[:, None] * stride_pk, mask=s_ok[:, None] & dv_ok[None, :], other=0.0)
            acc = tl.sum(part * w[:, None], 0)
        else:  # more than a program's registers hold (MERGE_TILE): MERGE_CHUNK splits at a time
            acc = tl.zeros([BLOCK_DV], tl.float32)
            for s0 in range(0, used, MERGE_CHUNK):
                offs_c = s0 + tl.arange(0, MERGE_CHUNK)
                c_ok = offs_c < used
                w_c = tl.exp(tl.load(row_lse + offs_c, mask=c_ok, other=float("-inf")) - m)
                part = tl.load(row_part + offs_c[:, None] * stride_pk, mask=c_ok[:, None] & dv_ok[None, :],
                               other=0.0)
                acc += tl.sum(part * w_c[:, None], 0)
        out = acc / tl.maximum(denom, 1e-30)
        tl.store(Out + b * stride_ob + qi * stride_os + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty),
                 mask=dv_ok)
