"""Mosaic GPU (Hopper) flash-decoding attention for 65..128 query rows per KV head, warp-specialised.

Why: with 88-128 query rows per KV head (the 22-query draft of K = 11 with 4 query heads per KV head; GPT-OSS
verify with 8) the Triton kernel is latency-bound: each program waits on its own scores -> softmax -> PV chain
and the tensor cores idle during the softmax. Here each program (b, KV head h, split s) runs three warpgroups
(the FlashAttention-3 layout):
- warpgroup 2 streams [BK, hd] K and V tiles of the program's key range into a `stages`-deep shared-memory ring
  with TMA (barriers `k_full` / `v_full`; it reuses a slot once both consumers released it: `k_free` / `v_free`);
- warpgroups 0 and 1 each own 64 query rows (rows r = (query r // g, head-in-group r % g), as in the Triton kernel,
  padded to 128) and take turns on the tensor cores (barrier `turn`): while one runs its q k^T / p v `wgmma`, the
  other runs its online softmax (base 2, scale folded into one multiply-add).
With 65..96 rows and head_dim 128 at small batch (`swap_default`), warpgroup 1 instead takes the rows past 64 as
the wgmma N dimension with keys as M (s^T = k q^T, o^T += v^T p^T; the online softmax reduces over the key axis across
warps): 32 columns instead of 64 padded rows halve its products and exponentials.
Only tiles at the edges of the visible range apply the mask (causal diagonal, window start, kv_len). Each program
reads its row's key range and per-row positions from T scalar loads of q_pos (no XLA prologue launch); the q copy
is issued first, before those loads and the K/V ring (issued behind the ring, q arrives late at batch 1, when
every program requests its first tiles at once). Split s of ns takes tiles s, s + ns, s + 2 ns, ... of the range
(all programs stream neighbouring tiles at the same time); without a window the range starts at key 0, so its
first tiles are issued together with q, before the positions are read. The output is the same unnormalised
per-split (o, m, l) as `pallas.partials`, merged by the same Triton merge kernel (merging in the same launch, in a
thread-block cluster or behind a global semaphore, measured slower; docs/performance.md).
With few tiles per program (short caches) its fixed cost per program exceeds Triton's, so `api.choose` keeps
Triton there (`AttentionConfig.mosaic_min_tiles`).
Bytes moved: as the Triton kernel (K/V of the visible range once + the partials).
Numerics: 16-bit q / K / V only (wgmma); float32 inputs are not taken (they would multiply in TF32 whatever JAX's
default matmul precision says), so float32 attention always runs the Triton kernel or the reference.
Interpret mode (JAX >= 0.11, `_compat.mosaic_gpu_interpret_runs`) stages q and p through shared memory where the GPU
keeps them in registers; the outputs are the same arrays either way.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

import pjax._compat as _compat
from pjax.kernels import dispatch, hardware
from pjax.kernels.cache_attention.config import DEFAULT, AttentionConfig
from pjax.kernels.cache_attention.reference import check_inputs

ROWS = 128  # query rows per program: two consumer warpgroups x 64 (the wgmma M tile)
SWAP_COLS = 32  # rows past the first 64, up to this many, run as wgmma columns (see `cols_consumer`)
REDUCTION_SCRATCH = 2048  # shared-memory bytes for the swapped consumer's cross-warp (key axis) reductions
LOG2E = 1.4426950408889634


def _plgpu():
    return _compat.mosaic_gpu()


def _mgpu():
    from jax.experimental.mosaic import gpu as mgpu
    return mgpu


def available() -> bool:
    """True on a Hopper (sm_90) GPU whose JAX has Mosaic GPU's warp-specialised `plgpu.kernel`."""
    return (dispatch.on_gpu() and hardware.gpu().compute_capability == (9, 0)  # wgmma: sm_90a only
            and _compat.mosaic_gpu_warp_specialization())


def swapped(t: int, g: int, hd: int) -> bool:
    """True when the rows past the first 64 (at most SWAP_COLS) go to the second consumer as wgmma columns: with
    head_dim 128; with 64 its cross-warp reductions cost more than the halved products save."""
    return 64 < t * g <= 64 + SWAP_COLS and hd == 128


def swap_default(q, k, *, block_k: Optional[int] = None, config: AttentionConfig = DEFAULT) -> bool:
    """`swapped`, where each program streams fewer than config.swap_max_tiles tiles."""
    from pjax.kernels.cache_attention.pallas import num_splits
    block_k = block_k or config.mosaic_block_k
    b, t, nh, hd = q.shape
    s_len, nkv = k.shape[1], k.shape[2]
    tiles = -(-s_len // block_k)
    return swapped(t, nh // nkv, hd) and -(-tiles // num_splits(b, nkv, s_len, block_k)) < config.swap_max_tiles


def unsupported_reason(q, k, *, block_k: Optional[int] = None, stages: Optional[int] = None,
                       swap: Optional[bool] = None, config: AttentionConfig = DEFAULT) -> Optional[str]:
    """None when the kernel handles these inputs, else why not (the caller falls back to the Triton kernel);
    `swap` as in `partials` (None: `swap_default`)."""
    block_k = block_k or config.mosaic_block_k
    b, t, nh, hd = q.shape
    s_len, nkv = k.shape[1], k.shape[2]
    g = nh // nkv
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"dtype {q.dtype}/{k.dtype}: 16-bit q and K/V of one dtype only"
    if hd not in (64, 128):
        return f"head_dim {hd}: 64 or 128 only"
    if not 64 < t * g <= ROWS or ROWS % g:
        return f"{t} queries x {g} heads per KV head = {t * g} rows: 65..{ROWS} rows, g dividing {ROWS}"
    if s_len % block_k:
        return f"cache length {s_len} is not a multiple of block_k={block_k}"
    stages = stages or config.mosaic_stages
    swap = swap_default(q, k, block_k=block_k, config=config) if swap is None else swap and swapped(t, g, hd)
    budget = hardware.gpu().smem_per_block
    if _smem_bytes(block_k, stages, hd, 2, swap) > budget:
        return f"block_k={block_k} x {stages} stages x head_dim {hd} exceeds {budget} bytes of shared memory"
    return None


def _smem_bytes(bk, stages, hd, itemsize, swap):
    """K/V ring, q tile (staging o at the end), m and l, barriers; with `swap` also the second consumer's q^T, p^T
    (later its o^T) tiles, its m / l and the cross-warp reduction scratch."""
    if swap:
        return (2 * stages * bk + ROWS + 64) * hd * itemsize + max(bk, hd) * SWAP_COLS * itemsize + 2 * ROWS * 4 + \
            2 * SWAP_COLS * 4 + REDUCTION_SCRATCH + 2048
    return (2 * stages * bk + ROWS) * hd * itemsize + 2 * ROWS * 4 + 1024


def _row_range(pos_ref, len_ref, b, *, t, s_len, bk, window):
    """The key range of batch row b from T scalar loads of q_pos[b] (and kv_len[b]), in the kernel (no XLA prologue
    launch): (q positions [T], lo, n_blocks, e0, e1, kv_hi): tiles [lo + i * bk) for i < n_blocks cover the visible
    keys; tiles i < e0 and i >= e1 need the mask; keys >= kv_hi are hidden."""
    from pjax.kernels.cache_attention.pallas import key_range
    qp = [pos_ref[b, i] for i in range(t)]
    kv_hi = jnp.int32(s_len) if len_ref is None else jnp.minimum(len_ref[b], s_len)
    lo, full_lo, full_hi, n_blocks = key_range(functools.reduce(jnp.minimum, qp), functools.reduce(jnp.maximum, qp),
                                               kv_hi, bk=bk, window=window)
    e0 = jnp.clip((full_lo - lo + bk - 1) // bk, 0, n_blocks)
    e1 = jnp.clip((full_hi - lo) // bk, e0, n_blocks)
    return qp, lo, n_blocks, e0, e1, kv_hi


def _pick(idx, values):
    """values[idx] for an int vector idx from a short list of scalars (a select chain; idx past the end -> last)."""
    out = values[-1]
    for i in range(len(values) - 2, -1, -1):
        out = jnp.where(idx == i, values[i], out)
    return out


def _kernel(q_ref, k_ref, v_ref, pos_ref, *refs, t, g, hd, s_len, bk, stages, ns, window, scale, has_len, swap,
            interpret):
    plgpu = _plgpu()
    refs = list(refs)
    len_ref = refs.pop(0) if has_len else None
    o_ref, m_ref, l_ref = refs
    dtype = q_ref.dtype
    c = scale * LOG2E

    def body(qo_smem, k_smem, v_smem, ml_smem, q_bar, k_full, v_full, k_free, v_free, turn, *extra):
        b, h, sp, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("wg")
        extra = list(extra)
        if swap:
            q1_smem, p_smem, ml1_smem = extra[:3]
            extra = extra[3:]

        def kv_copy(i, slot, lo, reuse=None):
            """K and V tile i of this program (keys lo + (sp + i ns) bk ...) into ring slot `slot`; where `reuse`, each
            once its slot is free."""
            keys = (b, pl.ds(pl.multiple_of(lo + (sp + i * ns) * bk, bk), bk), h)
            for ref, smem, full, free in ((k_ref, k_smem, k_full, k_free), (v_ref, v_smem, v_full, v_free)):
                if reuse is not None:
                    pl.when(reuse)(lambda: plgpu.barrier_wait(free.at[slot]))
                plgpu.copy_gmem_to_smem(ref.at[keys], smem.at[slot], full.at[slot])

        # Program sp takes tiles sp, sp + ns, sp + 2 ns, ... of the row's range. Without a window the range starts at
        # key 0, so its first `spec` tiles are known before the positions are read: the producer issues them at once
        # (the position loads are a memory round trip) and drains those past the range.
        spec = stages if window is None else 0

        @pl.when(wg == 2)
        def _issue_first():  # q first: issued behind the ring of every program, it arrives late at batch 1
            plgpu.set_max_registers(40, action="decrease")
            if interpret:  # q_ref holds the rows already ([B, nkv, ROWS, hd]), one tile per consumer
                for w in range(2):
                    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(w * 64, 64)], qo_smem.at[w], q_bar.at[w])
            else:  # one [T, g, hd] copy; rows (t, j) are its row-major reshape
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(0, t), pl.ds(h * g, g)], qo_smem.at[pl.ds(0, t)],
                                        q_bar.at[0])
            for i in range(spec):
                pl.when((sp + i * ns) * bk < s_len)(functools.partial(kv_copy, i, i, jnp.int32(0)))

        qp, lo, n_blocks, e0, e1, kv_hi = _row_range(pos_ref, len_ref, b, t=t, s_len=s_len, bk=bk, window=window)
        count = jnp.maximum(-((sp - n_blocks) // ns), 0)  # tiles sp + i ns < n_blocks
        # tiles [0, e0) and [e1, n_blocks) of the row's range need the mask: this program's i < a and i >= z
        a = jnp.clip(-((sp - e0) // ns), 0, count)
        z = jnp.clip(-((sp - e1) // ns), a, count)

        def masked_scores(s, i, row_pos, key_axis):
            kidx = plgpu.broadcasted_iota(jnp.int32, s.shape, key_axis, layout=plgpu.Layout.WGMMA) + (
                lo + (sp + i * ns) * bk)
            vis = (kidx <= row_pos) & (kidx < kv_hi)
            if window is not None:
                vis &= kidx > row_pos - window
            return jnp.where(vis, s, -jnp.inf)

        def softmax_update(s, m, l, acc, key_axis):
            """Online softmax step over `key_axis` of the scores s (base 2, scale folded into one multiply-add):
            (p, new running max m, new sum l, acc rescaled); acc's query axis is the one s keeps."""
            qdim = [1 - key_axis]
            m_new = jnp.maximum(m, s.max(axis=key_axis) * c)
            mc = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - mc)
            p = jnp.exp2(s * c - lax.broadcast_in_dim(mc, s.shape, qdim))
            return p, m_new, l * alpha + p.sum(axis=key_axis), acc * lax.broadcast_in_dim(alpha, acc.shape, qdim)

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        def run_tiles(step, carry):
            carry = lax.fori_loop(0, a, functools.partial(step, masked=True), carry)
            carry = lax.fori_loop(a, z, functools.partial(step, masked=False), carry)
            return lax.fori_loop(z, count, functools.partial(step, masked=True), carry)

        @pl.when(wg == 2)
        def _producer():
            for i in range(spec):  # issued tiles this program has no use for: wait until they have landed
                @pl.when((i >= count) & ((sp + i * ns) * bk < s_len))
                def _():
                    plgpu.barrier_wait(k_full.at[i])
                    plgpu.barrier_wait(v_full.at[i])

            @pl.loop(spec, count)
            def _(i):
                kv_copy(i, lax.rem(i, stages), lo, reuse=i >= stages)

            if interpret:  # the interpreter wants every phase of a barrier seen by each thread that waits on it:
                # the releases of the last tiles of each slot it reused (on the GPU nothing waits for them)
                @pl.loop(jnp.maximum(count - stages, stages), count)
                def _(j):
                    plgpu.barrier_wait(k_free.at[lax.rem(j, stages)])
                    plgpu.barrier_wait(v_free.at[lax.rem(j, stages)])

        def rows_consumer(wg):
            """64 query rows [64 wg, +64) as the wgmma M dimension: s = q k^T [64, bk], o += p v [64, hd]."""
            plgpu.set_max_registers(232, action="increase")
            wgmma_layout = plgpu.Layout.WGMMA
            row_layout = wgmma_layout.reduce(1)

            rows = pl.ds(wg * 64, 64)
            # row r = (query r // g, head r % g): its position, from the scalars (padding rows repeat the last query)
            t_idx = (plgpu.broadcasted_iota(jnp.int32, (64,), 0, layout=row_layout) + wg * 64) // g
            pos = _pick(t_idx, qp)
            if interpret:  # wgmma reads q from shared memory
                qo_rows = lhs = qo_smem.at[wg]
                plgpu.barrier_wait(q_bar.at[wg])
            else:  # wgmma reads q from registers
                plgpu.barrier_wait(q_bar.at[0])
                qo_rows = qo_smem.reshape(qo_smem.shape[0] * g, hd).at[rows]
                lhs = _compat.mosaic_gpu_load(qo_rows, wgmma_layout)
                ridx = plgpu.broadcasted_iota(jnp.int32, (64, hd), 0, layout=wgmma_layout) + wg * 64
                lhs = jnp.where(ridx < t * g, lhs, jnp.zeros_like(lhs))  # rows past T x g: stale shared memory

            def step(i, carry, masked):
                acc, m, l = carry
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(k_full.at[slot])

                def qk(s_ref):
                    plgpu.wgmma(s_ref, lhs, k_smem.at[slot].T)
                    take_turn()  # the other warpgroup's softmax runs while this product is in flight
                    return s_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((64, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    s = masked_scores(s, i, lax.broadcast_in_dim(pos, (64, bk), [0]), 1)
                p, m_new, l, acc = softmax_update(s, m, l, acc, key_axis=1)
                p16 = p.astype(dtype)
                plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may issue its products
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_wait(turn)

                if interpret:  # GPU interpret mode takes wgmma operands from shared memory only and has no rule
                    # for run_state: same sum through a shared-memory p tile and a fresh accumulator
                    p_smem = extra[0].at[wg]
                    p_smem[...] = p16

                    def pv(o_ref):
                        plgpu.wgmma(o_ref, p_smem, v_smem.at[slot])
                        return o_ref[...]
                    acc = acc + pl.run_scoped(pv, plgpu.ACC((64, hd), jnp.float32))
                else:
                    def pv(o_acc):
                        plgpu.wgmma(o_acc, p16, v_smem.at[slot])
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            carry = (plgpu.layout_cast(jnp.zeros((64, hd), jnp.float32), wgmma_layout),
                     plgpu.layout_cast(jnp.full((64,), -jnp.inf, jnp.float32), row_layout),
                     plgpu.layout_cast(jnp.zeros((64,), jnp.float32), row_layout))
            pl.when(wg == 1)(take_turn)  # offsets warpgroup 1 by half a step (wg static: a Python if)
            acc, m, l = run_tiles(step, carry)
            pl.when(wg == 0)(take_turn)  # balances warpgroup 1's extra turn

            qo_rows[...] = acc.astype(dtype)  # these q rows are no longer read: stage o there
            ml_smem.at[0, wg][...] = m * (1.0 / LOG2E)  # the merge works in units of scale * score
            ml_smem.at[1, wg][...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_rows, o_ref.at[b, sp, h, rows])
            plgpu.copy_smem_to_gmem(ml_smem.at[0, wg], m_ref.at[b, sp, h, rows])
            plgpu.copy_smem_to_gmem(ml_smem.at[1, wg], l_ref.at[b, sp, h, rows])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the CTA may exit once shared memory is read

        def cols_consumer():
            """Rows [64, 64 + SWAP_COLS) as the wgmma N dimension, keys as M: s^T = k q^T [bk, SWAP_COLS],
            o^T += v^T p^T [hd, SWAP_COLS]: half the products and exponentials of 64 padded rows. The online softmax
            runs over the key axis (cross-warp reductions); at the end one wgmma with a 0/1 matrix transposes o^T."""
            plgpu.set_max_registers(232, action="increase")
            wgmma_layout = plgpu.Layout.WGMMA
            col_layout = wgmma_layout.reduce(0)
            ncol = SWAP_COLS
            pt = p_smem.at[pl.ds(0, bk)]
            pos = _pick((plgpu.broadcasted_iota(jnp.int32, (ncol,), 0, layout=col_layout) + 64) // g, qp)
            if interpret:
                plgpu.barrier_wait(q_bar.at[1])
                q_cols = qo_smem.at[1, pl.ds(0, ncol)]
            else:  # rows 64.. from the q tile into a swizzled tile, the layout wgmma reads its B operand in
                plgpu.barrier_wait(q_bar.at[0])
                q_rows = _compat.mosaic_gpu_load(qo_smem.reshape(ROWS, hd).at[pl.ds(64, 64)], wgmma_layout)
                ridx = plgpu.broadcasted_iota(jnp.int32, (64, hd), 0, layout=wgmma_layout) + 64
                q1_smem[...] = jnp.where(ridx < t * g, q_rows, jnp.zeros_like(q_rows))
                plgpu.commit_smem()
                q_cols = q1_smem.at[pl.ds(0, ncol)]

            def step(i, carry, masked):
                acc, m, l = carry
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(k_full.at[slot])

                def qk(s_ref):
                    plgpu.wgmma(s_ref, k_smem.at[slot], q_cols.T)
                    take_turn()
                    return s_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((bk, ncol), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    s = masked_scores(s, i, lax.broadcast_in_dim(pos, (bk, ncol), [1]), 0)
                p, m_new, l, acc = softmax_update(s, m, l, acc, key_axis=0)
                pt[...] = p.astype(dtype)  # the previous product that read pt has completed
                plgpu.commit_smem()
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_wait(turn)
                if interpret:
                    def pv(o_ref):
                        plgpu.wgmma(o_ref, v_smem.at[slot].T, pt)
                        return o_ref[...]
                    acc = acc + pl.run_scoped(pv, plgpu.ACC((hd, ncol), jnp.float32))
                else:
                    def pv(o_acc):
                        plgpu.wgmma(o_acc, v_smem.at[slot].T, pt)
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            carry = (plgpu.layout_cast(jnp.zeros((hd, ncol), jnp.float32), wgmma_layout),
                     plgpu.layout_cast(jnp.full((ncol,), -jnp.inf, jnp.float32), col_layout),
                     plgpu.layout_cast(jnp.zeros((ncol,), jnp.float32), col_layout))
            take_turn()  # offsets this warpgroup by half a step
            acc, m, l = run_tiles(step, carry)

            # o rows [64, 64 + ncol) = eye [64, ncol] @ (o^T).T
            ot = p_smem.at[pl.ds(0, hd)]
            ot[...] = acc.astype(dtype)
            eye = jnp.where(plgpu.broadcasted_iota(jnp.int32, (64, ncol), 0, layout=wgmma_layout)
                            == plgpu.broadcasted_iota(jnp.int32, (64, ncol), 1, layout=wgmma_layout),
                            1.0, 0.0).astype(dtype)
            if interpret:
                eye_smem = extra[1]
                eye_smem[...] = eye
                eye = eye_smem
            plgpu.commit_smem()

            def transpose(o_t):
                plgpu.wgmma(o_t, eye, ot.T)
                return o_t[...]
            o_rows = pl.run_scoped(transpose, plgpu.ACC((64, hd), jnp.float32))
            ml1_smem.at[0][...] = m * (1.0 / LOG2E)
            ml1_smem.at[1][...] = l
            stage = q1_smem if not interpret else qo_smem.at[1]  # q^T is no longer read: stage o there
            stage[...] = o_rows.astype(dtype)
            plgpu.commit_smem()
            rows = pl.ds(64, ncol)
            plgpu.copy_smem_to_gmem(stage.at[pl.ds(0, ncol)], o_ref.at[b, sp, h, rows])
            plgpu.copy_smem_to_gmem(ml1_smem.at[0], m_ref.at[b, sp, h, rows])
            plgpu.copy_smem_to_gmem(ml1_smem.at[1], l_ref.at[b, sp, h, rows])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        if swap:
            pl.when(wg == 0)(lambda: rows_consumer(0))
            pl.when(wg == 1)(cols_consumer)
        else:
            pl.when(wg < 2)(lambda: rows_consumer(wg))

    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tiled64 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))
    if interpret:
        q_tile = plgpu.SMEM((2, 64, hd), dtype, transforms=tiled)
    else:
        q_tile = plgpu.SMEM((ROWS // g, g, hd), dtype)
    scratch = [plgpu.SMEM((64, hd), dtype, transforms=tiled),  # the swapped rows' q (their o at the end)
                    plgpu.SMEM((max(bk, hd), SWAP_COLS), dtype, transforms=tiled64),  # p^T, at the end o^T
                    plgpu.SMEM((2, SWAP_COLS), jnp.float32)] if swap else []
    if interpret:  # the first consumer's p tiles (and the swapped one's 0/1 matrix): wgmma operands in smem
        scratch += [plgpu.SMEM((2, 64, bk), dtype, transforms=tiled)] + (
            [plgpu.SMEM((64, SWAP_COLS), dtype, transforms=tiled64)] if swap else [])
    pl.run_scoped(
        body,
        q_tile,
        plgpu.SMEM((stages, bk, hd), dtype, transforms=tiled),
        plgpu.SMEM((stages, bk, hd), dtype, transforms=tiled64 if swap else tiled),
        plgpu.SMEM((2, 2, 64), jnp.float32),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
        *scratch,
        collective_axes="wg",
    )


def partials(q, k, v, q_pos, *, scale: float, window: Optional[int] = None, kv_len=None,
             block_k: Optional[int] = None, stages: Optional[int] = None, splits: Optional[int] = None,
             swap: Optional[bool] = None, config: AttentionConfig = DEFAULT, interpret: Optional[bool] = None):
    """Same outputs as `pallas.partials` (o [B, ns, nkv, R, hd] in q's dtype, m, l [B, ns, nkv, R] f32; R = ROWS, or
    64 + SWAP_COLS with `swap`: rows past 64 as wgmma columns, by default where `swap_default`), in interpret mode
    too (interpret: None = interpret mode off GPU; it needs JAX >= 0.11). block_k / stages / splits force a value
    (else the config's and `pallas.num_splits`)."""
    from pjax.kernels.cache_attention.pallas import num_splits
    plgpu = _plgpu()
    interpret = dispatch.interpret(interpret)
    block_k = block_k or config.mosaic_block_k
    b, t, nh, hd = q.shape
    s_len, nkv = k.shape[1], k.shape[2]
    g = nh // nkv
    reason = unsupported_reason(q, k, block_k=block_k, stages=stages, swap=swap, config=config)
    if reason:
        raise ValueError(f"cache_attention implementation='mosaic': {reason}")
    if swap is None:
        swap = swap_default(q, k, block_k=block_k, config=config)
    elif swap and not swapped(t, g, hd):
        raise ValueError(f"cache_attention implementation='mosaic': swap=True needs 65..{64 + SWAP_COLS} rows and "
                         f"head_dim 128, found {t} queries x {g} heads = {t * g} rows, head_dim {hd}")
    stages = stages or config.mosaic_stages
    ns = splits or num_splits(b, nkv, s_len, block_k)
    f32 = jnp.float32
    kern = functools.partial(_kernel, t=t, g=g, hd=hd, s_len=s_len, bk=block_k, stages=stages, ns=ns, window=window,
                             scale=float(scale), has_len=kv_len is not None, swap=swap, interpret=interpret)
    ins = [q, k, v, q_pos.astype(jnp.int32)] + ([] if kv_len is None else [jnp.asarray(kv_len, jnp.int32)])
    if interpret:  # rows r = (query r // g, head-in-group r % g) of each KV head, padded: [B, nkv, ROWS, hd]
        rows = q.reshape(b, t, nkv, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, nkv, t * g, hd)
        ins[0] = jnp.pad(rows, ((0, 0), (0, 0), (0, ROWS - t * g), (0, 0)))
    rows = 64 + SWAP_COLS if swap else ROWS  # every partial row is written (the merge reads them from L2)
    return plgpu.kernel(
        kern,
        out_type=(jax.ShapeDtypeStruct((b, ns, nkv, rows, hd), q.dtype), jax.ShapeDtypeStruct((b, ns, nkv, rows), f32),
                  jax.ShapeDtypeStruct((b, ns, nkv, rows), f32)),
        grid=(b, nkv, ns), grid_names=("b", "h", "s"), num_threads=3, thread_name="wg",
        # row reductions stay in-warp; the swapped consumer's key-axis reductions cross warps. Lane semantics (the
        # JAX 0.10 default, explicit for 0.11): every register layout here is explicit, and Warpgroup semantics'
        # layout inference compiles several times slower for the same kernel time
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=REDUCTION_SCRATCH if swap else 0,
                                             lowering_semantics=_mgpu().LoweringSemantics.Lane),
        **({"interpret": _compat.mosaic_gpu_interpret_params()} if interpret else {}),
    )(*ins)


def cache_attention(q, k, v, q_pos, *, scale: float, window: Optional[int] = None, sinks=None, kv_len=None,
                    block_k: Optional[int] = None, stages: Optional[int] = None, splits: Optional[int] = None,
                    swap: Optional[bool] = None, config: AttentionConfig = DEFAULT, interpret: Optional[bool] = None):
    """Same contract as `pjax.kernels.cache_attention.reference.cache_attention` for the inputs `unsupported_reason`
    accepts (raises ValueError naming why for others); `partials` for the other arguments."""
    from pjax.kernels.cache_attention.pallas import merge
    check_inputs(q, k, v, q_pos, kv_len, sinks)
    parts = partials(q, k, v, q_pos, scale=scale, window=window, kv_len=kv_len, block_k=block_k, stages=stages,
                     splits=splits, swap=swap, config=config, interpret=interpret)
    _, t, nh, hd = q.shape
    return merge(*parts, t=t, nh=nh, hd=hd, sinks=sinks, dtype=q.dtype, config=config, interpret=interpret)
