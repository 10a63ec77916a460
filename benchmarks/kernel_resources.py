"""Registers and spills of the fused kernels per tile config, compiled for sm_90 without a GPU.

Costs no device time (`stableflash.attention.triton.offline`): run it before spending GPU time on tuning.
Rows: the native kernels (`fa2`: plain, SFA, SFA + statistics) over the autotuner's candidate tiles, the Gluon
forward at the tiles `ops` launches on sm_90 (`hopper.FORWARD_TILES`, kernel "fwd-gluon"), and the emulated ones at
their fixed tile (`paper`; `fp32`, whose matmul operands are fp32; the dp_p δ pass). Each row
also says whether ptxas runs the kernel's wgmmas one after another (`offline.wgmma_serialization`).

    python benchmarks/kernel_resources.py --out results/kernel-resources-sm90.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from stableflash import SFA
from stableflash.attention.precision import resolve
from stableflash.attention.triton import ops
from stableflash.attention.triton.offline import compile_function, compile_kernel, constexprs, resource_usage, wgmma_serialization
from stableflash.attention.triton.spec import build_spec


def row(policy, stabilize, kernel: str, head_dim: int, config: triton.Config | None, variant: str,
        stats: bool = False) -> dict:
    """One kernel at one tile; `config` None: the emulated kernels' own tile for this policy (`ops._emu_config`)."""
    spec = build_spec(policy, stabilize, torch.bfloat16, 4096)
    key = ops.register_spec(spec)
    config = config or ops._emu_config(spec.ops_fp32, head_dim)
    consts = constexprs(key, kernel, head_dim, config, stats=stats)
    compiled = compile_kernel(kernel, consts, config)
    return {"kernel": kernel, "variant": variant, "head_dim": head_dim, **config.kwargs, "warps": config.num_warps,
            "stages": config.num_stages, **resource_usage(compiled), "wgmma_serialized": wgmma_serialization(compiled)}


def gluon_forward_row(head_dim: int, tile, variant: str, stabilize, stats: bool) -> dict:
    """The Gluon forward at one of `hopper.FORWARD_TILES`, with the constants `ops.forward` gives it."""
    from triton.experimental.gluon._runtime import GluonASTSource

    key = ops.register_spec(build_spec(resolve("fa2"), stabilize, torch.bfloat16, 4096))
    consts, config = ops._hopper_constants(key, head_dim, torch.bfloat16, True, tile, stats)
    compiled = compile_function(ops.hopper._attn_fwd_hopper, {**consts, "num_warps": config.num_warps},
                                {"num_warps": config.num_warps}, source_type=GluonASTSource)
    return {"kernel": "fwd-gluon", "variant": variant + ("/pingpong" if tile.pingpong else ""), "head_dim": head_dim,
            "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "warps": tile.warps, "stages": tile.stages,
            **resource_usage(compiled), "wgmma_serialized": wgmma_serialization(compiled)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fa2, paper, fp32 = resolve("fa2"), resolve("paper"), resolve("fp32")
    rows = []
    for D in (64, 128):
        for cfg in ops._FWD_CONFIGS:
            for variant, stab, stats in (("plain", None, False), ("sfa", SFA(), False), ("sfa+stats", SFA(), True)):
                rows.append(row(fa2, stab, "fwd", D, cfg, variant, stats))
        for softmax_work, choice in ((w, ops.hopper.FORWARD_TILES.get((D, w))) for w in (False, True)):
            variants = (("sfa", SFA(), False), ("sfa+stats", SFA(), True)) if softmax_work else (("plain", None, False),)
            rows += [gluon_forward_row(D, choice.tile, *v) for v in variants] if choice else []
        for kernel, configs in (("dkdv", ops._DKDV_CONFIGS), ("dq", ops._DQ_CONFIGS)):
            rows += [row(fa2, None, kernel, D, cfg, "plain") for cfg in configs]
        for name, policy in (("paper", paper), ("fp32", fp32)):
            rows += [row(policy, None, kernel, D, None, name) for kernel in ("fwd", "dkdv", "dq")]
        for name, policy in (("fa2+dp_p", fa2), ("paper+dp_p", paper)):
            rows.append(row(policy.with_delta("dp_p"), None, "delta_dpp", D, None, name))
    print(f"{'kernel':<10}{'variant':<20}{'D':>4}{'BM':>5}{'BN':>5}{'warps':>6}{'stages':>7}{'regs':>6}{'spill B':>9}"
          f"{'shared B':>10}  wgmma")
    for r in rows:
        print(f"{r['kernel']:<10}{r['variant']:<20}{r['head_dim']:>4}{r['BLOCK_M']:>5}{r['BLOCK_N']:>5}{r['warps']:>6}"
              f"{r['stages']:>7}{r['registers']:>6}{r['spill_stack_bytes']:>9}{r['shared_bytes']:>10}  "
              f"{'serialised: ' + r['wgmma_serialized'] if r['wgmma_serialized'] else 'async'}")
    if args.out:
        meta = {"target": "sm_90", "triton": triton.__version__, "tool": "cuobjdump -res-usage",
                "specialisation": "pointers 16-byte aligned; strides, logical tiles and T (4096) divisible by 16"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
