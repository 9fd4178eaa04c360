"""NF4 quantization of one bf16 weight, as bitsandbytes does it."""

from __future__ import annotations

import torch

from poros.store.arena import NF4_BLOCKSIZE


def quantize_nf4(w: torch.Tensor):
    import bitsandbytes.functional as bnbf

    return bnbf.quantize_4bit(w, blocksize=NF4_BLOCKSIZE, compress_statistics=False, quant_type="nf4")
