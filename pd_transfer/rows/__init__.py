"""The row mover: rows of bytes moved by their addresses inside one device's memory, by one Triton kernel launch on a
CUDA device, else by torch by the widest element; the one place the IPC engine, the offload copier and the push
stager copy rows through.

Pure torch and numpy (Triton where it imports); no transport, engine or layout knowledge: callers give rows as
addresses (a plan's rows located in opened memory, a chunk's pages, a push's rows) and the memory they lie in.

* :mod:`.addresses`: rows as (source, target) addresses of one size, and the one element-width table;
* :mod:`.memory`: the storages rows lie in, found by address; rows paired with their memory;
* :mod:`.mover`: the choice of kernel or torch, and the kernel's launches (:func:`move_rows`);
* :mod:`.kernel`: the Triton kernel (compiled on CUDA, interpreted on host memory);
* :mod:`.by_torch`: the fallback, a group of torch calls per pair of storages;
* :mod:`.packed`: rows gathered into and scattered from a packed buffer (:class:`AddressedRows`).
"""

from .addresses import ELEMENT_TYPES, RowAddresses, widest_element
from .memory import RowCopy, RowMemory, RowsOutside, locate, storages
from .mover import (
    BLOCK_ELEMENTS,
    by_row_size,
    kernel_available,
    kernel_module,
    kernel_upload,
    launch_rows,
    move_rows,
    upload_to,
    use_kernel,
)
from .packed import AddressedRows

__all__ = [
    "BLOCK_ELEMENTS",
    "ELEMENT_TYPES",
    "AddressedRows",
    "RowAddresses",
    "RowCopy",
    "RowMemory",
    "RowsOutside",
    "by_row_size",
    "kernel_available",
    "kernel_module",
    "kernel_upload",
    "launch_rows",
    "locate",
    "move_rows",
    "storages",
    "upload_to",
    "use_kernel",
    "widest_element",
]
