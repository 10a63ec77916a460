"""A stand-in `flash_attn` package whose functions are stableflash's, for running flash-attn's own tests against them.

`research/flash_attn_tests.sh` puts this folder first on the path. The upstream modules the tests import besides the
attention functions (`bert_padding`, `layers.rotary` and its Triton kernel) are read from a flash-attn checkout
named by FLASH_ATTN_REPO, run as an outside oracle and never copied here.
"""

import os

from stableflash.attention.flash_attn import *  # noqa: F403 - flash-attn's seven functions (its `__all__`)

_upstream = os.environ.get("FLASH_ATTN_REPO")
if _upstream:  # submodules not found here come from the checkout's package
    __path__.append(os.path.join(_upstream, "flash_attn"))  # noqa: F405 - the package's own __path__
