# mypy: ignore-errors
"""The row mover's Triton kernel: every row of a call copied in one launch, from and to addresses.

Imported only where Triton is (a CUDA machine with vLLM's or torch's Triton; the ``dev`` extra installs it for the
tests), so mypy skips this file and :mod:`.mover` holds everything that can be checked without it. Program ``(row,
part)`` copies elements ``[part * BLOCK, (part + 1) * BLOCK)`` of row ``row`` (``row_elems`` elements of ``DTYPE``)
from the address ``sources[row]`` to ``targets[row]`` (int64 addresses, as the grouped GEMM tutorial loads its
pointers), the elements past the row's end masked off. Launched with address tensors on a CUDA device, it runs
compiled on that device's current stream; with address tensors on the CPU, it runs under Triton's interpreter on
host memory (what ``TRITON_INTERPRET=1`` makes of every ``triton.jit`` function, here for this launch only): the
very kernel, element by element, as the tests run it.
"""

import functools

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


@functools.cache
def _interpreted():
    """The kernel's function under Triton's interpreter (built once, on first use on host memory)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(copy_rows_kernel.fn)


def launch(sources, targets, rows: int, row_elems: int, block: int, element_bytes: int) -> None:
    """Queue the kernel: ``rows`` rows of ``row_elems`` integers of ``element_bytes`` bytes each (8, 4, 2 or 1),
    ``block`` elements a program; ``sources`` and ``targets`` are int64 tensors of ``rows`` addresses, on the CUDA
    device whose memory they address (its current stream), or on the CPU for host memory (the interpreter, done on
    return)."""
    dtype = getattr(tl, f"int{8 * element_bytes}")
    kernel = copy_rows_kernel if sources.is_cuda else _interpreted()
    kernel[(rows, triton.cdiv(row_elems, block))](sources, targets, row_elems, BLOCK=block, DTYPE=dtype)
