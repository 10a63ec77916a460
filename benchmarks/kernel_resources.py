"""Registers and spills of the fused kernels per tile config, compiled for sm_90 without a GPU.

Triton compiles to a cubin for a named target on any machine; `cuobjdump -res-usage` (shipped in
Triton's wheel) reads its resource use. Costs no device time: run it before spending GPU time on tuning.

    python benchmarks/kernel_resources.py --out results/kernel-resources-sm90.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from stableflash.attention.triton import kernels, ops

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
POINTERS = {**{n: "*bf16" for n in ("Q", "K", "V", "O", "OS", "DO", "DK", "DV", "DQ")},
            **{n: "*fp32" for n in ("LSE", "DELTA", "STAT_MAX")}, "STAT_COUNTS": "*i32"}
FLOATS = {"scale", "qk_scale", "eps_u"}
FWD_CODES = dict.fromkeys(ops._FWD_CODES, 0)
BWD_CODES = dict(EMU=False, OPS_FP32=False, **dict.fromkeys(ops._BWD_CODES, 0))


def resources(fn, constexprs: dict, warps: int, stages: int) -> dict:
    signature = {name: "constexpr" if name in constexprs else POINTERS.get(name, "fp32" if name in FLOATS else "i32")
                 for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=TARGET, options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([CUOBJDUMP, "-res-usage", cubin.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", report)
    return {"registers": int(found[1]), "spill_stack_bytes": int(found[2])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for D in (64, 128):
        for cfg in ops._FWD_CONFIGS:
            for stab, stats in ((0, False), (1, False), (1, True)):
                c = dict(HEAD_DIM=D, CAUSAL=True, EMU=False, OPS_FP32=False, SAVE_OS=False, STAB=stab, STATS=stats,
                         BETA=2.0, LOW=0.01, HIGH=20.0, BOUNDED=True, CLAMP_CEIL=1.0, TILE_CLAMP=0.0, **FWD_CODES,
                         **cfg.kwargs)
                rows.append({"kernel": "fwd", "variant": ["plain", "sfa", "sfa+stats"][stab + stats], "head_dim": D,
                             **cfg.kwargs, "warps": cfg.num_warps, "stages": cfg.num_stages,
                             **resources(kernels._attn_fwd, c, cfg.num_warps, cfg.num_stages)})
        for name, fn, configs, extra in (("dkdv", kernels._attn_bwd_dkdv, ops._DKDV_CONFIGS, dict(R_P_OP=0, R_DV=0, R_DK=0)),
                                         ("dq", kernels._attn_bwd_dq, ops._DQ_CONFIGS, dict(R_DQ=0))):
            for cfg in configs:
                c = dict(HEAD_DIM=D, CAUSAL=True, **BWD_CODES, **extra, **cfg.kwargs)
                rows.append({"kernel": name, "variant": "plain", "head_dim": D, **cfg.kwargs, "warps": cfg.num_warps,
                             "stages": cfg.num_stages, **resources(fn, c, cfg.num_warps, cfg.num_stages)})
    print(f"{'kernel':<6}{'variant':<11}{'D':>4}{'BM':>5}{'BN':>5}{'warps':>6}{'stages':>7}{'regs':>6}{'spill B':>9}")
    for r in rows:
        print(f"{r['kernel']:<6}{r['variant']:<11}{r['head_dim']:>4}{r['BLOCK_M']:>5}{r['BLOCK_N']:>5}{r['warps']:>6}"
              f"{r['stages']:>7}{r['registers']:>6}{r['spill_stack_bytes']:>9}")
    if args.out:
        meta = {"target": "sm_90", "triton": triton.__version__, "tool": "cuobjdump -res-usage"}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
