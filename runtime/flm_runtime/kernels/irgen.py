"""LLVM IR building blocks for the cpu backend's hand-written kernels (``qgemm``, ``attention``):
numba ``@intrinsic`` code generators emit vector IR through these where numba's auto-vectorizer
does not produce the instructions we want (integer dot products, reductions, fused multiply-adds
in a fixed order).

Generic LLVM vector types and intrinsics only (``llvm.fma``, ``llvm.vector.reduce.*``, ...):
LLVM lowers them for whatever CPU numba compiles for. Target-specific instructions
(``vpdpbusd``) stay in the kernel that chooses them.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils

I1, I8, I16, I32, I64, F16, F32 = (ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                                   ir.HalfType(), ir.FloatType())


def vec(t, n):
    """The vector type ``<n x t>``."""
    return ir.VectorType(t, n)


def splat(t, n, value):
    """The constant ``<n x t>`` with every lane ``value``."""
    return ir.Constant(vec(t, n), [ir.Constant(t, value)] * n)


def declare(builder, name, ret, args):
    """The function ``name`` (an LLVM intrinsic) of the builder's module, declared if need be."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def as_i64(builder, value):
    """An integer value widened (signed) to i64."""
    return builder.sext(value, I64) if value.type.width < 64 else value


def data_ptr(context, builder, array_type, array_value, elem):
    """The data pointer of an array argument, as a pointer to ``elem``."""
    return builder.bitcast(context.make_array(array_type)(context, builder, array_value).data, elem.as_pointer())


def row_ptr(context, builder, array_type, array_value, row, elem):
    """``&array[row, 0]`` as a pointer to ``elem`` (a 2-D array with contiguous rows)."""
    arr = context.make_array(array_type)(context, builder, array_value)
    stride = cgutils.unpack_tuple(builder, arr.strides, array_type.ndim)[0]
    base = builder.bitcast(arr.data, I8.as_pointer())
    return builder.bitcast(builder.gep(base, [builder.mul(row, stride)]), elem.as_pointer())


def load(builder, ptr, index, elem_type):
    """Load ``elem_type`` at element ``index`` of ``ptr`` (unaligned)."""
    return builder.load(builder.bitcast(builder.gep(ptr, [index]), elem_type.as_pointer()), align=1)


def store(builder, value, ptr, index):
    """Store ``value`` at element ``index`` of ``ptr`` (unaligned)."""
    builder.store(value, builder.bitcast(builder.gep(ptr, [index]), value.type.as_pointer()), align=1)


def prefetch(builder, ptr, index):
    """Prefetch the cache line holding element ``index`` of ``ptr`` for reading, into every cache
    level (never faults, past an array's end too)."""
    f = declare(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    address = builder.bitcast(builder.gep(ptr, [index]), I8.as_pointer())
    builder.call(f, [address, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def broadcast(builder, value, n):
    """``value`` repeated in an ``n``-lane vector."""
    first = builder.insert_element(ir.Constant(vec(value.type, n), None), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(first, first, ir.Constant(vec(I32, n), [0] * n))


def counted_loop(builder, count, inits):
    """Open a counted loop ``for i in range(count)`` (``count >= 1``, i64) whose body updates the
    values ``inits``; returns ``(i, phis, close)``, ``close(new_values)`` ends the body and leaves
    the builder after the loop, where ``new_values`` hold the final values."""
    entry = builder.block
    body = builder.append_basic_block("body")
    after = builder.append_basic_block("after")
    builder.branch(body)
    builder.position_at_end(body)
    i = builder.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    phis = []
    for v in inits:
        phi = builder.phi(v.type)
        phi.add_incoming(v, entry)
        phis.append(phi)

    def close(new_values):
        i_next = builder.add(i, ir.Constant(I64, 1))
        tail = builder.block
        i.add_incoming(i_next, tail)
        for phi, v in zip(phis, new_values):
            phi.add_incoming(v, tail)
        builder.cbranch(builder.icmp_signed("<", i_next, count), body, after)
        builder.position_at_end(after)

    return i, phis, close


def literal(t, what):
    """The value of a compile-time constant argument's type (an integer or boolean literal).

    Raises:
        numba.core.errors.TypingError: the argument is not a constant.
    """
    if not isinstance(t, (types.IntegerLiteral, types.BooleanLiteral)):
        raise numba.core.errors.TypingError(f"{what} must be a compile-time constant")
    return t.literal_value
