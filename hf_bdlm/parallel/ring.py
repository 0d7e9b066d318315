"""Ring transport: gathered K/V rotate peer to peer instead of being all-gathered.

With ``block_parallel_transport="ring"`` a rank never holds more than two K/V shards of the
ring (the one it computes on and the one arriving): at step ``s`` ring rank ``c`` holds the shard
of ring rank ``c - s`` and attends to it while the next shard travels (``batch_isend_irecv``);
partial results merge by log-sum-exp. Local sources (``csbp``'s own noisy block K/V) are computed
first, while the first shard is in flight.

Backward rotates the K/V shards again (recomputing instead of keeping them) together with the
gradient accumulators of the shard: each rank adds its contribution and passes the accumulator
on; after the last step it travels one hop more, back to its owner. Bytes received per rank:
forward ``(C-1)`` shards of K and of V; backward ``(C-1)`` shards of K and V plus ``C`` shards of
dK and dV — the price of the bounded memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention.kernels import backward_calls, forward_calls, new_accumulators, repeat_kv, sum_kv_groups
from .collectives import CommContext, InFlight


class _Rotation:
    """Send tensors to the next ring rank and receive the previous rank's, asynchronously."""

    def __init__(self, comm: CommContext, name: str):
        self.comm, self.name = comm, name
        me, size = comm.rank, comm.size
        self.next = dist.get_global_rank(comm.group, (me + 1) % size)
        self.prev = dist.get_global_rank(comm.group, (me - 1) % size)

    def start(self, tensors: list[torch.Tensor], label: str) -> InFlight:
        """Send ``tensors`` on and receive the previous rank's; ``wait()`` returns the received list."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in sent]
        ops = []
        for t, r in zip(sent, received):
            ops.append(dist.P2POp(dist.isend, t, self.next, self.comm.group))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.comm.group))
        works = dist.batch_isend_irecv(ops)
        ready_at = self.comm.started(f"{self.name}.ring_{label}", sum(r.numel() * r.element_size() for r in received),
                                     received[0].element_size())
        # The sent buffers must live until the transfer completes: the handle keeps them.
        return InFlight(self.comm, works, f"ring_{label}({self.name})", lambda: received, keep=tuple(sent),
                        ready_at=ready_at)


class RingAttention(torch.autograd.Function):
    """Attention of ``q`` over local sources (plans ``local_plans``) and a ring of K/V shards.

    ``shard_plans[o]`` plans the local queries against the shard owned by ring rank ``o``.
    """

    @staticmethod
    def forward(ctx, comm, local_plans, shard_plans, scale, groups, q, k_shard, v_shard, *local_kv):
        rotation = _Rotation(comm, "kv")
        out_acc, lse_acc = new_accumulators(q)
        mask_cache: dict = {}
        me, size = comm.rank, comm.size
        pending = rotation.start([k_shard, v_shard], "kv") if size > 1 else None
        local_extras = []
        for i, plan in enumerate(local_plans):
            keys = {0: repeat_kv(local_kv[2 * i], groups)}
            values = {0: repeat_kv(local_kv[2 * i + 1], groups)}
            local_extras.append(forward_calls(plan.calls, q, keys, values, scale, out_acc, lse_acc, mask_cache))
        shard_extras = {}
        k_cur, v_cur = k_shard, v_shard
        for step in range(size):
            owner = (me - step) % size
            if step > 0:
                k_cur, v_cur = pending.wait()
                pending = rotation.start([k_cur, v_cur], "kv") if step < size - 1 else None
            plan = shard_plans[owner]
            keys, values = {0: repeat_kv(k_cur, groups)}, {0: repeat_kv(v_cur, groups)}
            shard_extras[owner] = forward_calls(plan.calls, q, keys, values, scale, out_acc, lse_acc, mask_cache)
        out = out_acc.to(q.dtype)
        ctx.comm, ctx.local_plans, ctx.shard_plans, ctx.scale, ctx.groups = comm, local_plans, shard_plans, scale, groups
        ctx.mask_cache, ctx.local_extras, ctx.shard_extras = mask_cache, local_extras, shard_extras
        ctx.save_for_backward(q, out, lse_acc, k_shard, v_shard, *local_kv)
        ctx.mark_non_differentiable(lse_acc)
        return out, lse_acc

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, out, lse, k_shard, v_shard, *local_kv = ctx.saved_tensors
        comm, groups, scale = ctx.comm, ctx.groups, ctx.scale
        me, size = comm.rank, comm.size
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q)
        local_grads = []
        for i, plan in enumerate(ctx.local_plans):
            keys = {0: repeat_kv(local_kv[2 * i], groups)}
            values = {0: repeat_kv(local_kv[2 * i + 1], groups)}
            dks, dvs = {0: torch.zeros_like(keys[0])}, {0: torch.zeros_like(values[0])}
            backward_calls(plan.calls, ctx.local_extras[i], q, keys, values, grad_out, out, lse, scale,
                           ctx.mask_cache, dq, dks, dvs)
            local_grads += [sum_kv_groups(dks[0], groups), sum_kv_groups(dvs[0], groups)]
        kv_rotation = _Rotation(comm, "kv_backward")
        grad_rotation = _Rotation(comm, "dkv")
        k_cur, v_cur = k_shard, v_shard
        dk_acc, dv_acc = torch.zeros_like(k_shard), torch.zeros_like(v_shard)
        kv_pending = kv_rotation.start([k_cur, v_cur], "kv") if size > 1 else None
        grad_pending = None
        for step in range(size):
            owner = (me - step) % size
            if step > 0:
                k_cur, v_cur = kv_pending.wait()
                kv_pending = kv_rotation.start([k_cur, v_cur], "kv") if step < size - 1 else None
                dk_acc, dv_acc = grad_pending.wait()
            keys, values = {0: repeat_kv(k_cur, groups)}, {0: repeat_kv(v_cur, groups)}
            dks, dvs = {0: torch.zeros_like(keys[0])}, {0: torch.zeros_like(values[0])}
            backward_calls(ctx.shard_plans[owner].calls, ctx.shard_extras[owner], q, keys, values, grad_out, out,
                           lse, scale, ctx.mask_cache, dq, dks, dvs)
            dk_acc = dk_acc + sum_kv_groups(dks[0], groups)
            dv_acc = dv_acc + sum_kv_groups(dvs[0], groups)
            if size > 1:
                # The accumulator follows its shard; after the last step one more hop takes it home.
                grad_pending = grad_rotation.start([dk_acc, dv_acc], "dkv")
        if size > 1:
            dk_acc, dv_acc = grad_pending.wait()
        return (None, None, None, None, None, dq, dk_acc, dv_acc, *local_grads)


def ring_attention(comm: CommContext, q, shard, local_sources, local_plans, shard_plans, scale: float):
    """``q [b, H, T, d]`` over local ``[(k, v), ...]`` sources and the ring's K/V shards.

    ``shard`` is this rank's ``(k, v)`` shard (``[b, H_kv, S, d]``, equal ``S`` on every ring rank).
    """
    groups = q.shape[1] // shard[0].shape[1]
    flat = [t for kv in local_sources for t in kv]
    out, _ = RingAttention.apply(comm, local_plans, shard_plans, scale, groups, q, shard[0], shard[1], *flat)
    return out
