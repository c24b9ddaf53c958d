"""Paged attention in plain torch: raylm's CPU path, and the reference the GPU kernels are tested against.

A step's requests are cut into a few groups of similar shape. Each group gathers its requests'
KV blocks into one padded batch and makes one `scaled_dot_product_attention` call, whose CPU
flash kernel is fused, multi-threaded and handles GQA without repeating KV heads. On a CPU with
an fp32 cache, single-token queries (decodes) skip the gather: the native kernel of
cpu_ops.py reads their keys and values in place, all of them in one call. An FP8 cache is gathered as
it is stored and dequantized into the queries' dtype before the SDPA call: half the bytes of a bf16
cache, read at its speed or slower (the conversion is one more pass over the gathered blocks).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from kernels.cpu_ops import load_cpu_ops
from kernels.formats import FP8_MAX
from kernels.metadata import AttentionMetadata

FP8 = torch.float8_e4m3fn

# What one more group call (a few gathers and an SDPA launch, ~70 us on one core) is worth in
# padded query x key pairs: about 150 padded decode keys, or a thousand padded prefill pairs.
_GROUP_COST = 256


@dataclass(slots=True)
class _Group:
    """Requests attended in one SDPA call, padded to `q_len` queries and `kv_len` keys each.

    Invariants, for n requests: `tokens` [n * q_len] names the step's token row of each padded
    query; a padding row repeats its request's last token, so every mask row keeps a key.
    `real` [m] picks the rows that are real tokens (None when there is no padding row) and
    `out_tokens` [m] names where they go. `block_tables` is [n, max_blocks]. `mask(window)` is
    [n, 1, q_len, kv_len] bool (True = attend: the query's own and earlier keys, only the last `window`
    of them when given), made once per window and step; None without a window for one request with no
    cached context, for which SDPA's top-left causal mask is exact.
    """

    tokens: torch.Tensor
    real: torch.Tensor | None
    out_tokens: torch.Tensor
    block_tables: torch.Tensor
    mask: Callable[[int | None], torch.Tensor | None]
    q_len: int
    kv_len: int


@dataclass(slots=True)
class _DecodeGroup:
    """Every single-token query of a step, for the native decode kernel: `tokens` [n] names each
    query's row, `block_tables` [n, max_blocks] and `seq_lens` [n] are int32 and contiguous.
    `fallback` rebuilds them as an SDPA group, for a cache the kernel does not take (not fp32 on CPU)."""

    tokens: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    fallback: Callable[[], _Group]


class TorchBackend:
    """Batched over requests with SDPA; every index and mask is made once per step in `plan`.

    Gathers copy whole blocks and pad to the group's longest context, so the unused tail of a
    request's last block and padded table entries (block 0) are read and masked out: they must
    hold finite values, as a zero-initialised cache written only by `store_kv` does. The gathered
    blocks land in one scratch buffer that every call reuses (so calls must not overlap):
    allocated afresh, its megabytes come back from the OS as new pages whose faults cost as much
    as the attention itself.
    """

    name = "torch"
    graph_capturable = False  # plan reads the lengths on the host and builds per-step index tensors

    def __init__(self, native_decode: bool = True) -> None:
        self._scratch = torch.empty(0)
        self._paged_decode = torch.ops.raylm.paged_decode if native_decode and load_cpu_ops() else None

    def plan(self, md: AttentionMetadata) -> list[_Group | _DecodeGroup]:
        starts = md.query_start_loc.tolist()
        seq_lens = md.seq_lens.tolist()
        q_lens = [end - start for start, end in pairwise(starts)]
        groups: list[_Group | _DecodeGroup] = []
        rest = range(len(q_lens))
        if self._paged_decode is not None and md.block_tables.device.type == "cpu":
            decodes = [b for b in rest if q_lens[b] == 1]
            rest = [b for b in rest if q_lens[b] != 1]
            if decodes:
                groups.append(_make_decode_group(decodes, starts, q_lens, seq_lens, md))
        if rest:
            sub_q, sub_s = [q_lens[b] for b in rest], [seq_lens[b] for b in rest]
            groups += [
                _make_group([rest[i] for i in members], starts, q_lens, seq_lens, md.block_tables)
                for members in _partition(sub_q, sub_s)
            ]
        return groups

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        _, _, _, kv_heads, head_dim = kv_cache.shape
        for i, (x, x_scale) in enumerate(((k, k_scale), (v, v_scale))):
            pages = kv_cache[i].view(-1, kv_heads, head_dim)
            if kv_cache.dtype == FP8:
                # index_copy_ has no float8 kernel on CPU: the bytes are copied.
                x = (x.float() / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
                pages = pages.view(torch.uint8)
            pages.index_copy_(0, slot_mapping, x)

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """`window`: each query attends to its last `window` positions only (itself included), or all when None."""
        out = q.new_empty(q.shape)
        for group in md.plan:
            if isinstance(group, _DecodeGroup):
                if kv_cache.dtype == q.dtype == torch.float32 and kv_cache.device.type == "cpu":
                    rows = self._paged_decode(
                        q.index_select(0, group.tokens),
                        kv_cache[0],
                        kv_cache[1],
                        group.block_tables,
                        group.seq_lens,
                        scale,
                        window or 0,
                    )
                    out.index_copy_(0, group.tokens, rows)
                    continue
                group = group.fallback()
            k, v = self._gather_kv(kv_cache, group)
            if kv_cache.dtype == FP8:
                k, v = k.to(q.dtype).mul_(k_scale), v.to(q.dtype).mul_(v_scale)
            out.index_copy_(0, group.out_tokens, _attend(q, k, v, group, scale, window))
        return out

    def _gather_kv(self, kv_cache: torch.Tensor, g: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's keys and values, each [n, kv_heads, kv_len, head_dim], in the scratch buffer."""
        _, _, block_size, kv_heads, head_dim = kv_cache.shape
        blocks = g.block_tables[:, : -(-g.kv_len // block_size)].flatten()
        shape = (2, blocks.numel(), block_size, kv_heads, head_dim)
        size = math.prod(shape)
        if (
            self._scratch.numel() < size
            or self._scratch.dtype != kv_cache.dtype
            or self._scratch.device != kv_cache.device
        ):
            self._scratch = kv_cache.new_empty(size)
        gathered = self._scratch[:size].view(shape)
        # Whole blocks make the gather a few large row copies; the tail past kv_len is only sliced off. FP8 pages are
        # copied as bytes: index kernels are not built for float8 on every device.
        for i in (0, 1):
            pages, out = kv_cache[i], gathered[i]
            if kv_cache.dtype == FP8:
                pages, out = pages.view(torch.uint8), out.view(torch.uint8)
            torch.index_select(pages, 0, blocks, out=out)
        n = g.block_tables.shape[0]
        k, v = (gathered[i].view(n, -1, kv_heads, head_dim)[:, : g.kv_len].transpose(1, 2) for i in (0, 1))
        return k, v


def _partition(q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Requests sorted by shape (decodes first, by context length), cut greedily: a request joins
    the current group unless the padding that adds exceeds the cost of a group of its own."""
    groups: list[list[int]] = []
    members: list[int] = []
    max_q = max_s = 0
    for b in sorted(range(len(q_lens)), key=lambda b: (q_lens[b], seq_lens[b])):
        new_q, new_s = max(max_q, q_lens[b]), max(max_s, seq_lens[b])
        padding = (len(members) + 1) * new_q * new_s - len(members) * max_q * max_s - q_lens[b] * seq_lens[b]
        if members and padding > _GROUP_COST:
            groups.append(members)
            members, new_q, new_s = [], q_lens[b], seq_lens[b]
        members.append(b)
        max_q, max_s = new_q, new_s
    return [*groups, members]


def _make_group(
    members: list[int], starts: list[int], q_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor
) -> _Group:
    """Indices and mask of one group, built on CPU from python ints and moved once per step."""
    device = block_tables.device
    first = torch.tensor([starts[b] for b in members])
    q_len_b = torch.tensor([q_lens[b] for b in members])
    seq_len_b = torch.tensor([seq_lens[b] for b in members])
    q_len, kv_len = int(q_len_b.max()), int(seq_len_b.max())
    row = torch.arange(q_len).expand(len(members), q_len)
    is_real = row < q_len_b[:, None]
    clamped = torch.minimum(row, q_len_b[:, None] - 1)
    tokens = (first[:, None] + clamped).flatten()
    real = None if bool(is_real.all()) else is_real.flatten().nonzero().squeeze(1)
    causal = len(members) == 1 and q_len == kv_len
    positions = seq_len_b[:, None] - q_len_b[:, None] + clamped

    @functools.cache
    def mask(window: int | None) -> torch.Tensor | None:
        if causal and window is None:
            return None
        keys = torch.arange(kv_len)
        visible = keys <= positions[..., None]
        if window is not None:
            visible &= keys > positions[..., None] - window
        return visible.unsqueeze(1).to(device)

    return _Group(
        tokens=tokens.to(device),
        real=None if real is None else real.to(device),
        out_tokens=(tokens if real is None else tokens[real]).to(device),
        block_tables=block_tables[torch.tensor(members, device=device)],
        mask=mask,
        q_len=q_len,
        kv_len=kv_len,
    )


def _make_decode_group(
    members: list[int], starts: list[int], q_lens: list[int], seq_lens: list[int], md: AttentionMetadata
) -> _DecodeGroup:
    index = torch.tensor(members)
    return _DecodeGroup(
        tokens=torch.tensor([starts[b] for b in members]),
        block_tables=md.block_tables.index_select(0, index).contiguous(),
        seq_lens=md.seq_lens.index_select(0, index).contiguous(),
        # Built once, on the first layer that needs it, then shared by the rest.
        fallback=functools.cache(lambda: _make_group(members, starts, q_lens, seq_lens, md.block_tables)),
    )


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: _Group, scale: float, window: int | None
) -> torch.Tensor:
    """Attention output of the group's real query rows, [m, num_heads, head_dim]."""
    n, kv_heads, _, head_dim = k.shape
    mask = g.mask(window)
    num_heads = q.shape[1]
    qg = q.index_select(0, g.tokens)
    if g.q_len == 1:
        # Query heads sharing a KV head become that head's rows, so each KV page is read once.
        out = F.scaled_dot_product_attention(qg.view(n, kv_heads, -1, head_dim), k, v, attn_mask=mask, scale=scale)
        rows = out.reshape(n, num_heads, head_dim)
    else:
        out = F.scaled_dot_product_attention(
            qg.view(n, g.q_len, num_heads, head_dim).transpose(1, 2),
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        rows = out.transpose(1, 2).reshape(n * g.q_len, num_heads, head_dim)
    return rows if g.real is None else rows.index_select(0, g.real)
