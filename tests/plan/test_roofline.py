"""`aot.roofline`: max(flops / peak, HBM bytes / bandwidth) + collective bytes / link bandwidth, per device, from
the chips' published figures; per-target accelerator types; `memory_analysis` drops XLA:CPU options by name."""

from __future__ import annotations

import pytest

from logra_jax.parallel import sharding as shd
from logra_jax.planner import aot


def test_roofline_adds_collective_time_to_the_overlapped_compute_and_memory():
    """Hand numbers on H100 (989.4 TFLOP/s, 3.35 TB/s, NVLink 900 GB/s both ways → 450 GB/s received)."""
    info = aot.target_info("h100:4")
    r = aot.roofline(989.4e12 * 0.2, 3.35e12 * 0.5, 450e9 * 0.1, info)
    assert (r.compute, r.memory, r.collective) == pytest.approx((0.2, 0.5, 0.1))
    assert r.seconds == pytest.approx(0.6) and r.bound == "memory"
    assert aot.roofline_seconds(989.4e12 * 0.2, 3.35e12 * 0.5, 450e9 * 0.1, "h100:4") == pytest.approx(0.6)


@pytest.mark.parametrize(("target", "link"), [("v5e:2x2", 200e9), ("v5p:2x2x1", 600e9), ("v6e:2x4", 400e9),
                                              ("v4:2x2x1", 6 * 45e9 / 2), ("h200:8", 450e9), ("a100:8", 300e9)])
def test_link_bandwidth_is_half_the_published_bidirectional_figure_per_device(target, link):
    """Cloud TPU docs' bidirectional ICI per chip (v5e 400, v5p 1200, v6e 800 GB/s), v4 6 links × 45 GB/s
    one-way over its 2 TensorCore devices, NVLink 900 / 600 GB/s both ways."""
    assert aot.target_info(target).link_bandwidth == pytest.approx(link)


def test_roofline_refuses_cpu_targets_and_negative_costs():
    with pytest.raises(ValueError, match="cpu:8"):
        aot.roofline(1.0, 1.0, 1.0, "cpu:8")
    with pytest.raises(ValueError, match="collective_bytes=-1"):
        aot.roofline(1.0, 1.0, -1, "v5e:2x2")


def test_each_tpu_target_names_its_own_accelerator_type():
    assert [aot.accelerator_type(t) for t in ("v4:2x2x1", "v5e:2x4", "v5p:2x2x1", "v6e:2x2")] == [
        "v4-8", "v5litepod-8", "v5p-8", "v6e-4"]
    with pytest.raises(ValueError, match="h100:8"):
        aot.accelerator_type("h100:8")


def test_fast_cpu_compile_options_are_dropped_by_name_off_cpu():
    """A copy of FAST_CPU_COMPILE (not the object itself) is dropped for a TPU or GPU compile; other options stay;
    a CPU compile keeps everything."""
    from logra_jax.planner.memory_analysis import options_for

    copy = dict(shd.FAST_CPU_COMPILE)
    assert copy is not shd.FAST_CPU_COMPILE
    assert options_for("tpu", copy) is None and options_for("gpu", copy) is None
    assert options_for("gpu", {**copy, "xla_dump_to": "/d"}) == {"xla_dump_to": "/d"}
    assert options_for("cpu", copy) == copy and options_for("tpu", None) is None
