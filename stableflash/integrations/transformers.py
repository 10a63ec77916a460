"""stableflash as a `transformers` attention implementation.

    from stableflash.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="stableflash_sfa")

`"stableflash"` computes FA2's numerics, `"stableflash_sfa"` adds stabilized flash attention (the bounded rule, which
the fused kernels run). Both take flash-attn's masks from `transformers`: a (B, Tk) padding mask or none, packed
sequences through `position_ids` that restart at 0 (batch size 1), a sliding-window model's `sliding_window` and
Gemma 2's `softcap`, so they honour padding, packing, windows and caps as `flash_attention_2` does. GQA's k and v
arrive with their own head count and are never repeated in memory by us.
"""

from __future__ import annotations

import torch

from stableflash.attention import SFA, flash_attention
from stableflash.attention.flash_attn import flash_attn_varlen_func
from stableflash.integrations.watch import active_watch

IMPLEMENTATIONS = {"stableflash": None, "stableflash_sfa": SFA()}


def _packed_offsets(position_ids: torch.Tensor | None, batch_size: int) -> torch.Tensor | None:
    """Cumulative sequence lengths of a packed row (batch 1, positions restarting at 0), or None if not packed.
    Only a batch of one row can be packed (as transformers' own flash-attn path decides, from shapes alone): models
    hand every batch a (1, T) `position_ids`, and reading its values would cost a sync and, compiled, a graph break
    in every layer."""
    if batch_size != 1 or position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    starts = (position_ids[0] == 0).nonzero().flatten()
    if starts.numel() <= 1:
        return None
    length = position_ids.shape[1]
    return torch.cat([starts, torch.tensor([length], device=starts.device)]).to(torch.int32)


def _make_forward(stabilize, precision_default: str = "fa2", backend: str = "auto"):
    def stableflash_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                      scaling: float | None = None, is_causal: bool | None = None, **kwargs):
        """query (B, H, Tq, D), key and value (B, H_kv, Tk, D); returns ((B, Tq, H, D), None) as transformers
        expects of an attention function."""
        if dropout:
            raise ValueError(f"dropout: stableflash attention has no dropout (got {dropout}); set the model's "
                             "attention dropout to 0")
        softcap = kwargs.get("softcap") or 0.0  # Gemma 2's attention logit cap
        if kwargs.get("s_aux") is not None:
            raise ValueError("s_aux: attention sinks are not supported by stableflash attention")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        device = query.device.type
        if torch.is_autocast_enabled(device):  # as autocast runs SDPA: q, k, v in its dtype (RoPE hands fp32 q, k)
            query, key, value = (t.to(torch.get_autocast_dtype(device)) for t in (query, key, value))
        keep = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"attention_mask: expected the (B, Tk) padding mask of flash-attn style "
                                 f"implementations, got shape {tuple(attention_mask.shape)}")
            keep = attention_mask.bool()
            # eagerly, a mask with no padding is dropped (the plain kernels are faster); compiled, reading it would
            # break the graph, and the masked form gives the same result
            if not torch.compiler.is_compiling() and keep.all():
                keep = None
        precision, stabilize_here, stats = precision_default, stabilize, None
        watcher = active_watch()
        if watcher is not None and getattr(module, "layer_idx", None) is not None:
            precision, switched, stats = watcher.attention_for(module.layer_idx)
            stabilize_here = switched or stabilize
        # packed sequences: the offsets transformers' DataCollatorWithFlattening passes, else from position_ids
        # a sliding-window model's window, as transformers' own flash-attn path sets it
        sliding = kwargs.get("sliding_window")
        window = (sliding - 1, sliding - 1) if sliding is not None and key.shape[2] > sliding else None
        offsets, key_offsets = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if offsets is None and keep is None and query.shape[2] > 1:
            offsets = _packed_offsets(kwargs.get("position_ids"), query.shape[0])
        key_offsets = offsets if key_offsets is None else key_offsets
        if offsets is not None and query.shape[0] == 1:
            out = flash_attn_varlen_func(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                         offsets, key_offsets, query.shape[2], key.shape[2], softmax_scale=scaling,
                                         causal=causal, window_size=window or (-1, -1), softcap=softcap,
                                         precision=precision, stabilize=stabilize_here, stats=stats, backend=backend)
            return out[None], None
        out = flash_attention(query, key, value, causal=causal, scale=scaling, key_padding_mask=keep, window=window,
                              softcap=softcap, stabilize=stabilize_here, precision=precision, stats=stats,
                              backend=backend)
        return out.transpose(1, 2).contiguous(), None

    return stableflash_attention_forward


def _skip_flash_kernel_loading() -> None:
    """The one seam into transformers' internals. It takes any implementation whose name holds "flash" for a
    flash-attn kernel to import (from the package or the Hub) when a model is built; ours are registered functions
    with nothing to import, so the model builder's loader is wrapped to pass over exactly these names."""
    import transformers.modeling_utils as modeling_utils

    loader = modeling_utils.lazy_import_flash_attention
    if getattr(loader, "stableflash_names", None) is not None:
        return

    def lazy_import_flash_attention(implementation=None, *args, **kwargs):
        if implementation in IMPLEMENTATIONS:
            return None
        return loader(implementation, *args, **kwargs)

    lazy_import_flash_attention.stableflash_names = tuple(IMPLEMENTATIONS)
    modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention


def register() -> list[str]:
    """Register `"stableflash"` and `"stableflash_sfa"` with transformers' attention and mask interfaces."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:
        raise ImportError("stableflash.integrations.transformers: needs transformers >= 5; install the extra: "
                          "pip install 'stableflash[transformers]'") from None
    for name, stabilize in IMPLEMENTATIONS.items():
        AttentionInterface.register(name, _make_forward(stabilize))
        AttentionMaskInterface.register(name, flash_attention_mask)
    _skip_flash_kernel_loading()
    return list(IMPLEMENTATIONS)
