"""Block-quantised FP8 (``awex.meta.quant``'s format: ``X.weight`` in ``float8_e4m3fn`` and ``X.weight_scale_inv`` in
float32, one scale per 128 x 128 tile): :mod:`~awex.convert.fp8.blocks` (one weight, quantise and dequantise),
:mod:`~awex.convert.fp8.kernels` (the Triton kernels), :mod:`~awex.convert.fp8.batched` (many weights in one
launch), :mod:`~awex.convert.fp8.views` (a sender's FP8 views of its own weights)."""

from awex.convert.fp8.batched import BatchedFp8Quantizer
from awex.convert.fp8.blocks import dequantize_fp8_blocks, fp8_max, quantize_fp8_blocks
from awex.convert.fp8.views import Fp8Views

__all__ = ["BatchedFp8Quantizer", "Fp8Views", "dequantize_fp8_blocks", "fp8_max", "quantize_fp8_blocks"]
