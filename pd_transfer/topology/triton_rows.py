# mypy: ignore-errors
"""The Triton kernel of :mod:`.row_copy`: every row of a pull copied in one launch, from and to addresses.

Imported only where Triton is (a CUDA machine with vLLM's or torch's Triton); CI has none, so mypy skips this file
and :mod:`.row_copy` holds everything that can be checked without it. Program ``(row, part)`` copies elements
``[part * BLOCK, (part + 1) * BLOCK)`` of row ``row`` (``row_elems`` elements of ``DTYPE``) from the address
``sources[row]`` to ``targets[row]`` (int64 device addresses, as the grouped GEMM tutorial loads its pointers).
"""

import triton
import triton.language as tl


@triton.jit
def copy_rows_kernel(sources, targets, row_elems, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    source = tl.load(sources + row).to(tl.pointer_type(DTYPE))
    target = tl.load(targets + row).to(tl.pointer_type(DTYPE))
    offsets = part * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < row_elems
    tl.store(target + offsets, tl.load(source + offsets, mask=inside), mask=inside)


def launch(sources, targets, rows: int, row_elems: int, block: int, dtype_name: str) -> None:
    """Queue the kernel on the current CUDA stream: ``rows`` rows of ``row_elems`` elements of ``dtype_name``
    (``int64``, ``int32``, ``int16`` or ``int8``), ``block`` elements a program."""
    dtype = {"int64": tl.int64, "int32": tl.int32, "int16": tl.int16, "int8": tl.int8}[dtype_name]
    grid = (rows, triton.cdiv(row_elems, block))
    copy_rows_kernel[grid](sources, targets, row_elems, BLOCK=block, DTYPE=dtype)
