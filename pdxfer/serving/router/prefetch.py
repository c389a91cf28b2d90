"""``prefetch(arr, i)`` in numba code: asks the CPU to bring ``arr[i]``'s cache line in
(LLVM's ``llvm.prefetch``: a hint, never a fault, and nothing waits on it). A hash map's
batched probes issue it some keys ahead, so many misses are under way at once; a plain load
instead holds the pipeline until its line arrives.
"""

from __future__ import annotations

from typing import Any

from .jit import ir, numba

types, cgutils, intrinsic = numba.types, numba.core.cgutils, numba.extending.intrinsic


@intrinsic
def prefetch(typingctx: Any, arr: Any, i: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        aty = sig.args[0]
        a = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, a, [args[1]], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            f"llvm.prefetch.{i8p.intrinsic_name}",
        )
        # a read (0), kept in all cache levels (3), of data (1)
        builder.call(
            fn,
            [
                builder.bitcast(ptr, i8p),
                ir.Constant(i32, 0),
                ir.Constant(i32, 3),
                ir.Constant(i32, 1),
            ],
        )
        return context.get_dummy_value()

    return types.void(arr, i), codegen
