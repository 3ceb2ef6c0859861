"""Every Triton kernel of graphtap against its torch reference on a real GPU (compiled,
not interpreted), on random tables: steering (residual and z rows, head gains, gates of
conditional steers), probes,
attention patterns and attention mass on a paged cache. Needs torch and Triton only (no
vLLM): `PYTHONPATH=overlay python -m benchmarks.gpu.check_kernels`. Exits 1 on a mismatch."""
from __future__ import annotations

import json
import math
import sys

import torch

from graphtap.engine.tables import Sizes, allocate
from graphtap.ops.backend import TORCH
from graphtap.ops.tables import KeyCache, Label
from graphtap.spec.positions import position_bitmap

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tables(**kw):
    base = dict(max_reqs=4, max_tokens=64, max_len=256, num_sites=3, hidden=128,
                steer_width=128, dtype=torch.float32, max_steers=3, max_vectors=6,
                max_captures=2, capture_rows=16, capture_width=128, pattern_rows=32,
                num_heads=4, patterns=True, max_probes=2, probe_width=3, probe_rows=32,
                max_spans=3, mass_rows=32)
    return allocate(Sizes(**{**base, **kw}), TORCH, DEV).ops


def check_steer(dtype) -> float:
    from graphtap.ops.steer import steer_reference
    from graphtap.ops.steer_triton import steer_triton

    g = torch.Generator(device="cpu").manual_seed(0)
    t = tables(dtype=dtype).steer
    t.bank[1:] = torch.randn(6, 128, generator=g).to(dtype).to(DEV)
    t.inv_norm[1:] = 1.0 / t.bank[1:].float().norm(dim=1)
    for slot in range(4):
        for e in range(3):
            op = (slot + 2 * e) % 5
            lo, hi = [(-math.inf, math.inf), (1.5, 1.5), (0.0, 0.0), (-0.3, 0.2),
                      (-math.inf, math.inf)][op]
            t.site[slot, e] = (slot + e) % 2
            t.vec[slot, e] = 1 + (slot * 3 + e) % 6
            t.coef[slot, e] = torch.tensor([2.5 if op == 0 else 0.0, lo, hi,
                                            -0.75 if op == 4 else 0.0], device=DEV)
            t.pos[slot, e] = torch.from_numpy(position_bitmap("all", 6, 256, t.pos.shape[2]))
    tok_slot = torch.randint(0, 5, (64,), generator=g).to(DEV)
    x = torch.randn(64, 128, generator=g).to(dtype).to(DEV)
    other = torch.randn(64, 128, generator=g).to(dtype).to(DEV)
    pos = torch.randint(0, 200, (64,), generator=g).to(DEV)
    ref, tri = x.clone(), x.clone()
    steer_reference(t, tok_slot, ref, other, pos, 1)
    steer_triton(t, tok_slot, tri, other, pos, 1)
    # relative to the stream's scale: bfloat16 rounds each side once (one ulp apart)
    return float((ref.float() - tri.float()).abs().max() / ref.float().abs().max())


def check_conditions() -> float:
    """Conditional steering: gates decided at site 0 (projection above, below, sigmoid
    probe), steers at site 1; the kernel's gates must equal the reference's exactly, and
    the steered rows agree like plain steering. Returns the relative difference (inf on
    a gate that differs)."""
    from graphtap.ops.steer import steer_reference
    from graphtap.ops.steer_triton import steer_triton

    outs, gates = [], []
    for op in (steer_reference, steer_triton):
        g = torch.Generator(device="cpu").manual_seed(5)
        t = tables().steer
        t.bank[1:] = torch.randn(6, 128, generator=g).to(DEV)
        t.inv_norm[1:] = 1.0 / t.bank[1:].norm(dim=1)
        for slot in range(4):
            t.site[slot, 0], t.vec[slot, 0] = 1, 1 + slot
            t.coef[slot, 0] = torch.tensor([2.0, -math.inf, math.inf, 0.0], device=DEV)
            t.pos[slot, 0] = torch.from_numpy(position_bitmap("generated", 6, 256,
                                                              t.pos.shape[2]))
            t.cond_site[slot, 0], t.cond_vec[slot, 0], t.cond_pos[slot, 0] = 0, 5 + slot % 2, 5
            t.cond_mode[slot, 0] = [1, 5, 2, 0][slot]  # unit, unit|below, sigmoid, plain
            t.cond_coef[slot, 0] = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.5, 0.5],
                                                 [-1.0, 0.0]][slot], device=DEV)
        tok_slot = torch.arange(64, device=DEV) % 5
        pos = torch.where(torch.arange(64, device=DEV) < 5, 5, 6 + torch.arange(64, device=DEV))
        x = torch.randn(64, 128, generator=g).to(DEV)
        for site in (0, 1):
            op(t, tok_slot, x, None, pos, site)
        outs.append(x)
        gates.append(t.gate[:4, 0].clone())
    if not torch.equal(gates[0], gates[1]) or gates[0].tolist().count(1) not in (1, 2, 3):
        return math.inf
    return float((outs[0] - outs[1]).abs().max() / outs[0].abs().max())


def check_probe() -> float:
    from graphtap.ops.probe import probe_reference
    from graphtap.ops.probe_triton import probe_triton

    g = torch.Generator(device="cpu").manual_seed(1)
    out = []
    for op in (probe_reference, probe_triton):
        ops = tables()
        t, bank = ops.probe, ops.steer.bank
        bank[1:] = torch.randn(6, 128, generator=g.manual_seed(1)).to(DEV)
        t.entry_site[0, 1], t.entry_site[1, 0] = 1, 1
        t.entry_vec[0, 1] = torch.tensor([1, 2, 0], dtype=torch.int32, device=DEV)
        t.entry_vec[1, 0] = torch.tensor([3, 4, 5], dtype=torch.int32, device=DEV)
        t.entry_bias[1, 0] = torch.tensor([1.0, 0.0, -1.0], device=DEV)
        t.entry_act[1, 0] = 1
        tok_slot = torch.tensor([0, 1] * 32, device=DEV)
        t.dst[1] = t.rows
        t.dst[1, :20] = torch.arange(20, device=DEV)
        x = torch.randn(64, 128, generator=g.manual_seed(2)).to(DEV)
        op(t, bank, tok_slot, x, None, 1)
        out.append(t.buf[:20].clone())
    return float((out[0] - out[1]).abs().max())


def paged():
    g = torch.Generator(device="cpu").manual_seed(3)
    kv = torch.randn(12, 16, 2, 2 * 64, generator=g).transpose(1, 2).to(DEV)  # FLASH_ATTN
    from graphtap.ops.pattern import key_cache_view

    keys = key_cache_view(kv, "FLASH_ATTN", 64)
    table = torch.tensor([[5, 2, 9, 0, 1, 3, 4, 6], [0, 11, 7, 8, 10, 1, 2, 3]],
                         dtype=torch.int32, device=DEV)
    return KeyCache(keys, table, 0.125, 2)


def label(t, rows):
    t.labels[:, Label.SITE] = -1
    for i, (site, tok, head, brow, pos, slot) in enumerate(rows):
        for col, v in ((Label.SITE, site), (Label.TOKEN, tok), (Label.HEAD, head),
                       (Label.BATCH_ROW, brow), (Label.POSITION, pos), (Label.SLOT, slot)):
            t.labels[i, col] = v


def check_attention() -> dict:
    from graphtap.ops.mass import mass_reference
    from graphtap.ops.mass_triton import mass_triton
    from graphtap.ops.pattern import pattern_reference
    from graphtap.ops.pattern_triton import pattern_triton

    kc = paged()
    q = torch.randn(10, 4, 64, generator=torch.Generator().manual_seed(4)).to(DEV)
    rows = [(1, 0, 0, 0, 0, 0), (1, 3, 3, 0, 70, 0), (1, 4, 1, 1, 40, 1), (1, 9, 2, 1, 127, 1),
            (2, 5, 0, 1, 12, 1)]
    res = {}
    for name, ops in (("pattern", (pattern_reference, pattern_triton)),
                      ("mass", (mass_reference, mass_triton))):
        out = []
        for op in ops:
            all_t = tables()
            t = all_t.pattern if name == "pattern" else all_t.mass
            if name == "mass":
                for slot, sp in ((0, [(0, 1), (2, 30), (60, 128)]), (1, [(5, 6), (0, 200)])):
                    t.entry_site[slot, 0] = 1
                    t.entry_spans[slot, 0, :len(sp)] = torch.tensor(sp, dtype=torch.int32,
                                                                    device=DEV)
            label(t, rows)
            op(t, q, kc, 1)
            out.append(t.buf[:len(rows)].clone())
        res[name] = float((out[0] - out[1]).abs().max())
    return res


def main() -> int:
    found = {"steer_float32": check_steer(torch.float32),
             "steer_bfloat16": check_steer(torch.bfloat16), "conditions": check_conditions(),
             "probe": check_probe(),
             **check_attention(), "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (Triton interpreter)"}
    limits = {"steer_float32": 1e-6, "steer_bfloat16": 1e-2, "conditions": 1e-6,
              "probe": 1e-4, "pattern": 1e-5,
              "mass": 1e-5}
    bad = {k: v for k, v in found.items() if k in limits and not v <= limits[k]}
    print(json.dumps({**found, "ok": not bad}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
