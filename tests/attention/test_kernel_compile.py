"""The kernels compile for the H200 (sm_90) on any machine, no GPU needed.

Guards what the interpreter cannot see: Triton's compiler rejected the fp32-operand variant on the GPU
(an early `return` under a constexpr `if` left a bf16 dot of fp32 operands in the compiled code), while
the interpreter ran it fine.
"""

import pytest
import torch

pytest.importorskip("triton")

from stableflash.attention.precision import resolve  # noqa: E402
from stableflash.attention.triton import ops  # noqa: E402
from stableflash.attention.triton.offline import compile_kernel, constexprs, resource_usage  # noqa: E402
from stableflash.attention.triton.spec import build_spec  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("policy, kernel, config", [
    ("fp32", "fwd", ops._EMU_CONFIG), ("fp32", "dkdv", ops._EMU_CONFIG), ("fp32", "dq", ops._EMU_CONFIG),
    ("fa2+dp_p", "delta_dpp", ops._DELTA_DPP_CONFIG), ("paper+dp_p", "delta_dpp", ops._DELTA_DPP_CONFIG),
    ("fa2", "fwd", ops._FWD_CONFIGS[0]),
])
def test_kernel_compiles_for_sm90(policy, kernel, config):
    name, _, knob = policy.partition("+")
    pol = resolve(name).with_delta("dp_p") if knob else resolve(name)
    key = ops.register_spec(build_spec(pol, None, torch.bfloat16, 1000))
    usage = resource_usage(compile_kernel(kernel, constexprs(key, kernel, 64, config), config))
    assert 0 < usage["registers"] <= 255
