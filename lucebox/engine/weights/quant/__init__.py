"""GGUF-quantized weights kept quantized on the device.

`QuantWeight` (qtensor.py) holds a tensor's raw GGUF blocks; `dequant.py` is the exact pure-torch
dequantizer (the CPU path and the kernels' reference); `qlinear` (linear.py) computes x @ W.T from the
blocks: on CUDA with the Triton kernels of triton_qmm.py (a fused dequantize + dot, never a full dense copy
of the weight), elsewhere by dequantizing the weight for the call.
"""

from lucebox.engine.weights.quant.dequant import FORMATS, dequantize
from lucebox.engine.weights.quant.linear import qlinear
from lucebox.engine.weights.quant.qtensor import QUANT_TYPES, QuantWeight, row_bytes

__all__ = ["FORMATS", "QUANT_TYPES", "QuantWeight", "dequantize", "qlinear", "row_bytes"]
