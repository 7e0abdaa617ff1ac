"""`hlo_cost`: flops and bytes that follow the loops' trip counts, checked against XLA's own analysis on loop-free
programs, against hand-counted matmul flops through scans (nested too), and on hand-written HLO for the custom
calls the CPU compiler never emits (a TPU Pallas kernel's declared cost, cuBLAS, a Triton kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from logra_jax.planner.hlo_cost import hlo_cost, shape_bytes

F32 = jnp.float32


def _compiled(fn, *shapes, **jit_kwargs):
    return jax.jit(fn, **jit_kwargs).lower(*(jax.ShapeDtypeStruct(s, F32) for s in shapes)).compile()


def test_loop_free_program_agrees_with_xla_cost_analysis():
    """Without loops both count the same program: equal flops, transcendentals and bytes accessed."""
    compiled = _compiled(lambda a, b, c: (jnp.tanh(a @ b) * 2.0 + 1.0) @ c, (32, 64), (64, 128), (128, 16))
    ours, xla = hlo_cost(compiled.as_text()), compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list | tuple) else xla
    assert ours.matmul_flops == 2 * 32 * 64 * 128 + 2 * 32 * 128 * 16
    assert ours.flops == pytest.approx(xla["flops"], rel=0.02)
    assert ours.transcendentals == xla["transcendentals"] == 32 * 128
    assert ours.bytes_accessed == pytest.approx(xla["bytes accessed"], rel=0.02)


@pytest.mark.parametrize("layers", [3, 7])
def test_scan_counts_every_layer_forward_and_backward(layers):
    """The gradient of a scan of matmuls: 3 matmuls per layer (forward, dx, dW), each 2·m·n·k, every layer.
    XLA's own analysis counts one iteration per loop whatever `layers` is."""
    def loss(w, x):
        return (jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0] ** 2).sum()

    compiled = _compiled(jax.grad(loss), (layers, 64, 64), (32, 64))
    cost = hlo_cost(compiled.as_text())
    assert cost.matmul_flops == layers * 3 * 2 * 32 * 64 * 64
    assert cost.transcendentals == layers * 32 * 64  # tanh once per layer (the backward reuses it)
    assert cost.unknown_trip_counts == ()
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list | tuple) else xla
    assert xla["flops"] < cost.flops / 2  # the loop counted once


def test_nested_loops_multiply_trip_counts():
    def f(w, x):
        def outer(c, wi):
            return jax.lax.fori_loop(0, 5, lambda _, h: h @ wi, c), None
        return jax.lax.scan(outer, x, w)[0]

    cost = hlo_cost(_compiled(f, (4, 16, 16), (8, 16)).as_text())
    assert cost.matmul_flops == 4 * 5 * 2 * 8 * 16 * 16


def test_stacked_weights_are_read_once_per_layer_not_whole_each_iteration():
    """A layer's slice of the stacked [L, d, d] weights is read inside a fusion: bytes grow like L, not L² (a
    fusion's whole [L, d, d] operand counted per iteration would add ~L·d² per layer). XLA:CPU copies the slice
    out before its matmul reads it: about 3 slices of traffic per layer."""
    def f(w, x):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]

    small, large = (hlo_cost(_compiled(f, (n, 128, 128), (8, 128)).as_text()).bytes_accessed for n in (8, 32))
    weight_bytes = 128 * 128 * 4
    per_layer = (large - small) / 24
    assert weight_bytes <= per_layer <= 4 * weight_bytes


def test_collective_bytes_on_a_sharded_program():
    """An all-gather of an [64, 32] f32 array sharded over 8 devices: each device receives the 7 shards it lacks."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    rows, whole = NamedSharding(mesh, PartitionSpec("x")), NamedSharding(mesh, PartitionSpec())
    compiled = jax.jit(lambda a: a * 2.0, in_shardings=rows, out_shardings=whole).lower(
        jax.ShapeDtypeStruct((64, 32), F32)).compile()
    assert hlo_cost(compiled.as_text()).collective_bytes == 7 / 8 * 64 * 32 * 4


# Every collective form on 4 devices, 128-byte buffers (f32[32]): XLA:GPU's start/done pairs (all-gather-start's
# result is the tuple (operand, result), collective-permute-start's (operand, result), reduce-scatter-start's and
# all-to-all-start's ((operands), result)), an async-start wrapper, and the replica-group spellings.
_FORMS = """HloModule m, num_partitions=4

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%wrapped (w: f32[8]) -> f32[32] {
  %w = f32[8]{0} parameter(0)
  ROOT %g = f32[32]{0} all-gather(%w), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}
}

ENTRY %main (a: f32[32], q: f32[8]) -> f32[32] {
  %a = f32[32]{0} parameter(0)
  %q = f32[8]{0} parameter(1)
  %ag = (f32[8]{0}, f32[32]{0}) all-gather-start(%q), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = f32[32]{0} all-gather-done(%ag)
  %ar = f32[32]{0} all-reduce-start(%a), channel_id=2, replica_groups=mesh['x'=2,'y'=4] {'y'}, to_apply=%sum
  %ard = f32[32]{0} all-reduce-done(%ar)
  %rs = ((f32[32]{0}), f32[8]{0}) reduce-scatter-start(%a), channel_id=3, replica_groups={}, dimensions={0}, \
to_apply=%sum
  %rsd = f32[8]{0} reduce-scatter-done(%rs)
  %aa = ((f32[32]{0}), f32[32]{0}) all-to-all-start(%a), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}
  %aad = f32[32]{0} all-to-all-done(%aa)
  %cp = (f32[32]{0}, f32[32]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%a), channel_id=5, \
source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[32]{0} collective-permute-done(%cp)
  %w0 = ((f32[8]{0}), f32[32]{0}, s32[]) async-start(%q), calls=%wrapped
  %w1 = f32[32]{0} async-done(%w0)
  ROOT %out = f32[32]{0} add(%agd, %ard)
}
""".replace("\\\n", "")


def test_every_collective_form_counts_the_bytes_each_device_receives_once():
    """Ring hand counts over 4 devices: all-gather 32 − 8 floats, all-reduce 2 · 3/4 · 32, reduce-scatter
    32 − 8, all-to-all 3/4 · 32, collective-permute 32 — each once (a `*-done` is free), whatever the form of
    its replica groups ({{...}}, iota [1,4]<=[4], mesh[...] {axes}, {} = the module's 4 partitions)."""
    cost = hlo_cost(_FORMS)
    per_form = {"all-gather": 24 * 4, "all-reduce": 48 * 4, "reduce-scatter": 24 * 4, "all-to-all": 24 * 4,
                "collective-permute": 32 * 4, "async-start all-gather": 24 * 4}
    assert cost.collective_bytes == sum(per_form.values())
    assert cost.bytes_accessed == 3 * 32 * 4  # the add alone: collectives are not HBM traffic here


# libtpu's async all-gather inside a loop (trimmed from a compiled FSDP step): the start fusion (the collective
# consumed by an AsyncCollectiveStart custom call) and the done fusion in the outer body, continuation fusions in
# an inner loop (3 trips); all repeat the all-gather under one channel and chain id. Counted once per outer trip.
_TPU_ASYNC = """HloModule m, num_partitions=4

%start_fusion (p0: bf16[128,1024]) -> (bf16[128,1024], bf16[512,1024], u32[]) {
  %p0 = bf16[128,1024]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %ag0 = bf16[512,1024]{1,0:T(8,128)(2,1)} all-gather(%p0), channel_id=100, replica_groups=mesh['a'=4,'b'=1] \
{'a'}, dimensions={0}, frontend_attributes={chain_id="4"}
  ROOT %st = (bf16[128,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[512,1024]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) \
custom-call(%ag0), custom_call_target="AsyncCollectiveStart"
}

%continuation (c0: bf16[128,1024], c1: bf16[512,1024], c2: u32[]) -> (bf16[128,1024], bf16[512,1024], u32[]) {
  %c0 = bf16[128,1024]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %c1 = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  %c2 = u32[]{:S(2)} parameter(2)
  %ag1 = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} all-gather(%c0), channel_id=100, replica_groups=mesh['a'=4,'b'=1] \
{'a'}, dimensions={0}, frontend_attributes={chain_id="4"}
  ROOT %ct = (bf16[128,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[512,1024]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) \
tuple(%c0, %ag1, %c2)
}

%done_fusion (d0: bf16[128,1024], d1: bf16[512,1024], d2: u32[]) -> bf16[512,1024] {
  %d0 = bf16[128,1024]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %d1 = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  %d2 = u32[]{:S(2)} parameter(2)
  %ag2 = bf16[512,1024]{1,0:T(8,128)(2,1)} all-gather(%d0), channel_id=100, replica_groups=mesh['a'=4,'b'=1] \
{'a'}, dimensions={0}, frontend_attributes={chain_id="4"}
  ROOT %dn = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} custom-call(%d0, %d1, %ag2, %d2), \
custom_call_target="AsyncCollectiveDone"
}

%inner (i: (s32[], (bf16[128,1024], bf16[512,1024], u32[]))) -> (s32[], (bf16[128,1024], bf16[512,1024], u32[])) {
  %i = (s32[], (bf16[128,1024], bf16[512,1024], u32[])) parameter(0)
  %n = s32[] get-tuple-element(%i), index=0
  %h = (bf16[128,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[512,1024]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) \
get-tuple-element(%i), index=1
  %h0 = bf16[128,1024]{1,0:T(8,128)(2,1)S(1)} get-tuple-element(%h), index=0
  %h1 = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} get-tuple-element(%h), index=1
  %h2 = u32[]{:S(2)} get-tuple-element(%h), index=2
  %k = (bf16[128,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[512,1024]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) \
fusion(%h0, %h1, %h2), kind=kLoop, calls=%continuation
  ROOT %r = (s32[], (bf16[128,1024], bf16[512,1024], u32[])) tuple(%n, %k)
}

%inner_cond (ic: (s32[], (bf16[128,1024], bf16[512,1024], u32[]))) -> pred[] {
  %ic = (s32[], (bf16[128,1024], bf16[512,1024], u32[])) parameter(0)
  ROOT %t = pred[] constant(true)
}

%outer (o: (s32[], bf16[128,1024])) -> (s32[], bf16[128,1024]) {
  %o = (s32[], bf16[128,1024]{1,0:T(8,128)(2,1)}) parameter(0)
  %j = s32[] get-tuple-element(%o), index=0
  %shard = bf16[128,1024]{1,0:T(8,128)(2,1)} get-tuple-element(%o), index=1
  %s = (bf16[128,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[512,1024]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) \
fusion(%shard), kind=kLoop, calls=%start_fusion
  %z = s32[] constant(0)
  %init = (s32[], (bf16[128,1024], bf16[512,1024], u32[])) tuple(%z, %s)
  %loop = (s32[], (bf16[128,1024], bf16[512,1024], u32[])) while(%init), condition=%inner_cond, body=%inner, \
backend_config={"known_trip_count":{"n":"3"}}
  %after = (bf16[128,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[512,1024]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) \
get-tuple-element(%loop), index=1
  %a0 = bf16[128,1024]{1,0:T(8,128)(2,1)S(1)} get-tuple-element(%after), index=0
  %a1 = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} get-tuple-element(%after), index=1
  %a2 = u32[]{:S(2)} get-tuple-element(%after), index=2
  %gathered = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} fusion(%a0, %a1, %a2), kind=kLoop, calls=%done_fusion
  ROOT %ro = (s32[], bf16[128,1024]{1,0:T(8,128)(2,1)}) tuple(%j, %shard)
}

%outer_cond (oc: (s32[], bf16[128,1024])) -> pred[] {
  %oc = (s32[], bf16[128,1024]) parameter(0)
  ROOT %u = pred[] constant(true)
}

ENTRY %main (w: bf16[128,1024]) -> (s32[], bf16[128,1024]) {
  %w = bf16[128,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %zero = s32[] constant(0)
  %t0 = (s32[], bf16[128,1024]{1,0:T(8,128)(2,1)}) tuple(%zero, %w)
  ROOT %l = (s32[], bf16[128,1024]{1,0:T(8,128)(2,1)}) while(%t0), condition=%outer_cond, body=%outer, \
backend_config={"known_trip_count":{"n":"5"}}
}
""".replace("\\\n", "")


def test_a_tpu_async_collective_counts_once_where_it_starts():
    """5 outer trips × one all-gather of a [128, 1024] bf16 shard over 4 devices (3 shards received), not again in
    its 3 inner-loop continuations or its done fusion; the start fusion reads the shard from HBM, everything else
    lives in VMEM (S(1)) or sync-flag memory (S(2)) and moves no HBM bytes."""
    cost = hlo_cost(_TPU_ASYNC)
    shard = 128 * 1024 * 2
    assert cost.collective_bytes == 5 * 3 * shard
    assert cost.bytes_accessed == 5 * shard


_FP8_AND_SPACES = """HloModule m

ENTRY %main (a: f8e4m3fn[64,32], b: f8e5m2[32,16], v: f32[1024]) -> (bf16[64,16], f8e4m3fn[64,32], f32[1024]) {
  %a = f8e4m3fn[64,32]{1,0} parameter(0)
  %b = f8e5m2[32,16]{1,0} parameter(1)
  %v = f32[1024]{0} parameter(2)
  %sum = f8e4m3fn[64,32]{1,0} add(%a, %a)
  %mm = (bf16[64,16]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8", \
backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],\
"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %out = bf16[64,16]{1,0} get-tuple-element(%mm), index=0
  %cs = (f32[1024]{0:S(1)}, f32[1024]{0}, u32[]{:S(2)}) copy-start(%v)
  %cd = f32[1024]{0:S(1)} copy-done(%cs)
  %back = f32[1024]{0} negate(%cd)
  ROOT %r = (bf16[64,16]{1,0}, f8e4m3fn[64,32]{1,0}, f32[1024]{0}) tuple(%out, %sum, %back)
}
""".replace("\\\n", "")


def test_fp8_types_and_memory_spaces():
    """fp8 arrays are 1 byte an element: the f8 add is 2048 flops reading 2 × 2048 bytes and writing 2048, the
    fp8 cuBLAS call 2·64·16·32 flops. A prefetch into memory space 1 (TPU VMEM) reads its HBM source once and
    writes nothing to HBM; the negate reads VMEM and writes 4 KiB to HBM."""
    cost = hlo_cost(_FP8_AND_SPACES)
    assert cost.matmul_flops == 2 * 64 * 16 * 32
    assert cost.flops == 2 * 64 * 16 * 32 + 64 * 32 + 1024
    cublas = 64 * 32 + 32 * 16 + 64 * 16 * 2
    assert cost.bytes_accessed == 3 * 64 * 32 + cublas + 4096 + 4096


_CUSTOM_CALLS = """HloModule m

%body (p: (s32[], f32[128,256])) -> (s32[], f32[128,256]) {
  %p = (s32[], f32[128,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[128,256]{1,0} get-tuple-element(%p), index=1
  %w = f32[256,256]{1,0} constant({...})
  %g = (f32[128,256]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", \
backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],\
"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %y = f32[128,256]{1,0} get-tuple-element(%g), index=0
  %k = f32[128,256]{1,0} custom-call(%y), custom_call_target="tpu_custom_call", \
backend_config={"custom_call_config": {"body": "x(", "cost_estimate": {\
"flops": 1000, "transcendentals": 7,
"bytes_accessed": 5
}, "serialization_format": 1}}
  %t = f32[128,256]{1,0} custom-call(%k), custom_call_target="__gpu$xla.gpu.triton", backend_config={}
  ROOT %r = (s32[], f32[128,256]{1,0}) tuple(%i, %t)
}

%cond (q: (s32[], f32[128,256])) -> pred[] {
  %q = (s32[], f32[128,256]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[128,256]) -> (s32[], f32[128,256]) {
  %a = f32[128,256]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[128,256]{1,0}) tuple(%z, %a)
  %known = (s32[], f32[128,256]{1,0}) while(%t0), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  ROOT %unknown = (s32[], f32[128,256]{1,0}) while(%known), condition=%cond, body=%body
}
""".replace("\\\n", "")


def test_custom_calls_cublas_declared_pallas_cost_and_uncounted_triton():
    """cuBLAS flops from its dot dimension numbers, a TPU Pallas kernel's declared cost_estimate (pretty-printed
    over several lines, as libtpu prints it), a Triton call listed as uncounted; a loop without a known trip count
    counts once and is named."""
    cost = hlo_cost(_CUSTOM_CALLS)
    per_iteration = 2 * 128 * 256 * 256 + 1000
    assert cost.matmul_flops == (3 + 1) * per_iteration
    assert cost.transcendentals == 4 * 7
    assert cost.unknown_trip_counts == ("unknown",)
    assert cost.uncounted_custom_calls == ("__gpu$xla.gpu.triton:t",)


def test_shape_bytes_and_bad_text():
    assert shape_bytes("bf16[4,8]{1,0:T(8,128)(2,1)}") == 64
    assert shape_bytes("(f32[2]{0}, /*index=1*/s32[], pred[3])") == 15
    with pytest.raises(ValueError, match="ENTRY"):
        hlo_cost("HloModule empty\n")


_COUNTED = """HloModule m

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,8]{1,0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %r = (s32[], f32[8,8]{1,0}) tuple(%next, %y)
}

%cond (q: (s32[], f32[8,8])) -> pred[] {
  %q = (s32[], f32[8,8]{1,0}) parameter(0)
  %n = s32[] constant(5)
  %c = s32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%c, %n), direction=LT
}

ENTRY %main (a: f32[8,8]) -> (s32[], f32[8,8]) {
  %a = f32[8,8]{1,0} parameter(0)
  %two = s32[] constant(2)
  %start = s32[] copy(%two)
  %t0 = (s32[], /*index=1*/f32[8,8]{1,0}) tuple(%start, /*index=1*/%a)
  ROOT %loop = (s32[], f32[8,8]{1,0}) while(%t0), condition=%cond, body=%body
}
"""


def test_a_counted_loop_without_annotation_gets_its_trip_count_from_its_condition():
    """libtpu leaves some `lax.map` loops unannotated: `counter < 5` from a counter starting at 2 runs 3 times."""
    cost = hlo_cost(_COUNTED)
    assert cost.matmul_flops == 3 * 2 * 8 * 8 * 8 and cost.unknown_trip_counts == ()


@pytest.mark.parametrize(("window", "padding", "lhs_dilation", "groups"), [
    ((3, 3), ((1, 1), (1, 1)), (1, 1), 1), ((2, 2), ((0, 0), (1, 1)), (2, 1), 1),
    ((3, 1), ((2, 2), (0, 0)), (1, 1), 2)])
def test_convolution_flops_count_only_real_input_positions(window, padding, lhs_dilation, groups):
    """The TPU compiler writes batched matmuls as convolutions with padding and dilation; their multiply-adds are
    the (output, window) pairs on real input elements, as XLA's own analysis counts them (loop-free here)."""
    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), padding, lhs_dilation=lhs_dilation,
                                            feature_group_count=groups)

    compiled = _compiled(conv, (2, 4, 9, 7), (6, 4 // groups, *window))
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list | tuple) else xla
    assert hlo_cost(compiled.as_text()).matmul_flops == pytest.approx(xla["flops"], rel=0.01)


def test_an_in_place_scatter_loop_writes_its_rows_not_the_buffer():
    """A decode-like loop scattering one row per sequence into a donated [4, 512, 256] buffer per iteration (the KV
    cache write): per iteration the rows are read, computed and written (≈ 5 row blocks of 4 KiB with the loop's
    own bookkeeping and the inputs read once), not the 2 MiB buffer read and written whole (what a scatter
    counted like any op gives). An unknown-trip-count loop's one iteration is reported apart."""
    n, B, S, D = 16, 4, 512, 256

    def f(buf, rows, index):
        return jax.lax.fori_loop(0, n, lambda i, b: b.at[jnp.arange(B), index + i].set(rows[i] * 2.0 + 1.0,
                                                                                      mode="drop"), buf)

    args = (jax.ShapeDtypeStruct((B, S, D), jnp.float32), jax.ShapeDtypeStruct((n, B, D), jnp.float32),
            jax.ShapeDtypeStruct((B,), jnp.int32))
    cost = hlo_cost(jax.jit(f, donate_argnums=0).lower(*args).compile().as_text())
    row_block, buffer = B * D * 4, B * S * D * 4
    assert 2 * row_block <= cost.bytes_accessed / n <= 6 * row_block < buffer / 50, cost.bytes_accessed / n

    def until_done(buf, rows, index):  # a while loop whose trip count depends on the data
        return jax.lax.while_loop(lambda c: c[0] < index[0] + 3,
                                  lambda c: (c[0] + 1, c[1].at[jnp.arange(B), c[0]].set(rows[0])), (0, buf))[1]

    cost = hlo_cost(jax.jit(until_done, donate_argnums=0).lower(*args).compile().as_text())
    assert cost.unknown_trip_counts and 0 < cost.unknown_loop_iteration[1] <= cost.bytes_accessed
    assert cost.unknown_loop_iteration[1] < buffer


# libtpu's tied LM head in a decode step: the embedding [V, D] reaches the head's matmul fusion through a nested
# fusion that only bitcasts it (the structure of the 1.5B decode step on v5e, whose head went uncounted), and
# a stacked weight [L, D, D] through a nested bitcast fusion whose output the matmul's fusion slices.
_NESTED_BITCAST = """HloModule m

%bitcast_embed (e0: bf16[1024,256]) -> bf16[1024,256] {
  %e0 = bf16[1024,256]{1,0} parameter(0)
  ROOT %b0 = bf16[1024,256]{1,0} bitcast(%e0)
}

%head (h0: bf16[1024,256], h1: bf16[8,256]) -> f32[8,1024] {
  %h0 = bf16[1024,256]{1,0} parameter(0)
  %h1 = bf16[8,256]{1,0} parameter(1)
  %w = bf16[1024,256]{1,0} fusion(%h0), kind=kLoop, calls=%bitcast_embed
  ROOT %logits = f32[8,1024]{1,0} dot(%h1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%bitcast_stack (s0: bf16[4,256,256]) -> bf16[4,256,256] {
  %s0 = bf16[4,256,256]{2,1,0} parameter(0)
  ROOT %b1 = bf16[4,256,256]{2,1,0} bitcast(%s0)
}

%layer (l0: bf16[4,256,256], l1: bf16[8,256], l2: s32[]) -> bf16[8,256] {
  %l0 = bf16[4,256,256]{2,1,0} parameter(0)
  %l1 = bf16[8,256]{1,0} parameter(1)
  %l2 = s32[] parameter(2)
  %stack = bf16[4,256,256]{2,1,0} fusion(%l0), kind=kLoop, calls=%bitcast_stack
  %zero = s32[] constant(0)
  %slice = bf16[1,256,256]{2,1,0} dynamic-slice(%stack, %l2, %zero, %zero), dynamic_slice_sizes={1,256,256}
  %wl = bf16[256,256]{1,0} bitcast(%slice)
  ROOT %y = bf16[8,256]{1,0} dot(%l1, %wl), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (e: bf16[1024,256], x: bf16[8,256], s: bf16[4,256,256], i: s32[]) -> (f32[8,1024], bf16[8,256]) {
  %e = bf16[1024,256]{1,0} parameter(0)
  %x = bf16[8,256]{1,0} parameter(1)
  %s = bf16[4,256,256]{2,1,0} parameter(2)
  %i = s32[] parameter(3)
  %head_out = f32[8,1024]{1,0} fusion(%e, %x), kind=kOutput, calls=%head
  %layer_out = bf16[8,256]{1,0} fusion(%s, %x, %i), kind=kOutput, calls=%layer
  ROOT %r = (f32[8,1024]{1,0}, bf16[8,256]{1,0}) tuple(%head_out, %layer_out)
}
"""


def test_a_weight_a_nested_fusion_only_bitcasts_is_read_as_its_caller_reads_it():
    """Hand count: the head's fusion reads the whole [1024, 256] bf16 embedding (through the nested bitcast
    fusion) and x [8, 256], and writes f32 logits [8, 1024]; the layer's fusion reads one [256, 256] slice of the
    [4, 256, 256] stack (the nested bitcast fusion's output is sliced), x and the index, and writes [8, 256]."""
    cost = hlo_cost(_NESTED_BITCAST)
    head = 1024 * 256 * 2 + 8 * 256 * 2 + 8 * 1024 * 4
    layer = 256 * 256 * 2 + 8 * 256 * 2 + 4 + 8 * 256 * 2
    assert cost.bytes_accessed == head + layer
    assert cost.matmul_flops == 2 * 8 * 1024 * 256 + 2 * 8 * 256 * 256
