"""The step-time model of gift_jax.apps.pod_estimate on hand-written schedules: each op's
roofline time from its shapes, synchronous collectives fully exposed, async ones covered by
the compute between start and done, one link at a time, loops by their trip count, and the
chip table's one-line errors."""

import pathlib
import subprocess
import sys

import pytest

from gift_jax.apps import pod
from gift_jax.apps import pod_estimate as pe

# a chip with round numbers: 1 TFLOP/s, 1 GB/s HBM, 2 GB/s ICI (1 GB/s each way), 0.5 GB/s DCN
CHIP = pe.Chip(1e12, 1e9, 2e9, 0.5e9, "test")
F32_1M = "f32[262144]"  # 1 MiB
GROUP = "replica_groups={{0,1,2,3}}, to_apply=%add"


def _module(entry: list[str], extra: str = "") -> str:
    body = "\n".join(f"  {line}" for line in entry)
    return (f"{extra}%add (a: f32[], b: f32[]) -> f32[] {{\n  %a = f32[] parameter(0)\n}}\n\n"
            f"ENTRY %main (p: {F32_1M}) -> {F32_1M} {{\n{body}\n}}\n")


def _compute(name: str, src: str) -> str:
    # an elementwise op: 2 MiB moved (operand + result), no FLOPs
    return f"%{name} = {F32_1M} multiply(%{src}, %{src})"


ALL_REDUCE_S = 2 * 3 / 4 * 2**20 / 1e9  # bus bytes of a 1 MiB all-reduce on 4, at 1 GB/s
OP_S = 2 * 2**20 / 1e9  # an elementwise op of _compute: its operand and result at 1 GB/s


def test_synchronous_collective_is_fully_exposed():
    hlo = _module([f"%p = {F32_1M} parameter(0)", _compute("c1", "p"),
                   f"ROOT %ar = {F32_1M} all-reduce(%c1), {GROUP}"])
    r = pe.replay(hlo, optimal_seconds=1e-3, chip_=CHIP, mesh=None)
    [coll] = r.collectives
    assert coll.kind == "all-reduce" and coll.link == "ICI"
    assert coll.seconds == pytest.approx(ALL_REDUCE_S)
    assert r.compute_s == pytest.approx(OP_S) and r.optimal_seconds == 1e-3  # reported only
    assert r.step_s == pytest.approx(OP_S + ALL_REDUCE_S)
    assert r.exposed_s == pytest.approx(ALL_REDUCE_S) == pytest.approx(r.stall_s())


@pytest.mark.parametrize("between", [0, 1, 4])
def test_async_collective_is_covered_by_the_compute_between_start_and_done(between):
    ops = [f"%p = {F32_1M} parameter(0)", _compute("c0", "p"),
           f"%ars = {F32_1M} all-reduce-start(%c0), {GROUP}"]
    ops += [_compute(f"b{i}", "c0") for i in range(between)]
    ops += [f"%ard = {F32_1M} all-reduce-done(%ars)", _compute("after", "ard")]
    hlo = _module(ops)
    r = pe.replay(hlo, optimal_seconds=0.0, chip_=CHIP, mesh=None)
    covered = min(ALL_REDUCE_S, between * OP_S)
    assert r.compute_s == pytest.approx(OP_S * (between + 2))
    assert r.exposed_s == pytest.approx(ALL_REDUCE_S - covered)
    assert r.collectives[0].stall == pytest.approx(ALL_REDUCE_S - covered)


def test_one_link_carries_one_collective_at_a_time():
    ops = [f"%p = {F32_1M} parameter(0)",
           f"%s1 = {F32_1M} all-reduce-start(%p), {GROUP}",
           f"%s2 = {F32_1M} all-reduce-start(%p), {GROUP}",
           f"%d1 = {F32_1M} all-reduce-done(%s1)", f"%d2 = {F32_1M} all-reduce-done(%s2)"]
    r = pe.replay(_module(ops), optimal_seconds=0.0, chip_=CHIP, mesh=None)
    assert r.step_s == pytest.approx(2 * ALL_REDUCE_S)  # queued, not concurrent
    assert r.comm_s("ICI") == pytest.approx(2 * ALL_REDUCE_S)


@pytest.mark.parametrize("annotated", [True, False])
def test_loops_count_their_trips(annotated):
    """XLA's known_trip_count annotation, or (as the TPU compiler's scheduled HLO has it) the
    constant bound of the loop's condition."""
    body = ("%body (t: f32[262144]) -> f32[262144] {\n"
            f"  %t = {F32_1M} parameter(0)\n"
            f"  %m = {F32_1M} multiply(%t, %t)\n"
            f"  ROOT %r = {F32_1M} all-reduce(%m), {GROUP}\n}}\n\n"
            "%cond (c: (s32[], f32[262144])) -> pred[] {\n"
            "  %bound = s32[] constant(5)\n"
            "  %i = s32[] get-tuple-element(%c), index=0\n"
            "  ROOT %lt = pred[] compare(%i, %bound), direction=LT\n}\n\n")
    trips = ', backend_config={"known_trip_count":{"n":"5"}}' if annotated else ""
    ops = [f"%p = {F32_1M} parameter(0)", _compute("c", "p"),
           f"ROOT %w = {F32_1M} while(%c), condition=%cond, body=%body{trips}"]
    r = pe.replay(_module(ops, extra=body), optimal_seconds=0.0, chip_=CHIP, mesh=None)
    [coll] = r.collectives
    assert coll.executions == 5
    assert r.comm_s() == pytest.approx(5 * ALL_REDUCE_S)
    # the body runs 5 times: 6 compute ops in all, plus 5 synchronous all-reduces
    assert r.compute_s == pytest.approx(6 * OP_S)
    assert r.step_s == pytest.approx(6 * OP_S + 5 * ALL_REDUCE_S)


def test_matmul_flops_weigh_more_than_their_bytes():
    ops = [f"%p = {F32_1M} parameter(0)", "%x = f32[1024,1024] bitcast(%p)",
           "%mm = f32[1024,1024] dot(%x, %x), lhs_contracting_dims={1}, "
           "rhs_contracting_dims={0}", f"%e = {F32_1M} multiply(%p, %p)"]
    comps, entry = pe.computations(_module(ops))
    costs = pe._Costs(comps, pe.Chip(1e12, 1e12, 2e9, None, "fast HBM"))
    types = {i.name: i.type for i in comps[entry]}
    mm, ew = (next(i for i in comps[entry] if i.name == n) for n in ("%mm", "%e"))
    assert costs.seconds(mm, types) == pytest.approx(2 * 1024**3 / 1e12)  # compute-bound
    assert costs.seconds(ew, types) == pytest.approx(2 * 2**20 / 1e12)  # memory-bound


def test_unknown_chips_get_one_line():
    with pytest.raises(pe.UnknownChipError, match=r"no published bandwidths for TPU 'v4'; "
                       r"step times are estimated for: v5p, v5e, v6e$"):
        pe.chip("v4")
    with pytest.raises(pe.UnknownChipError, match=r"no published DCN bandwidth for TPU 'v6e'; "
                       r"multi-slice step times are estimated for: v5p, v5e$"):
        pe.chip("v6e", multislice=True)
    assert pe.chip("v6e").peak_flops == 918e12


def test_windowed_einsum_counts_only_the_taps_that_meet_the_input():
    """The TPU compiler's windowed einsum: a convolution whose window of 2 slides over a
    spatial dimension of 1 padded by 1 on each side, so each output takes one real tap."""
    line = ("%c = bf16[2048,2,32] convolution(%x, %w), window={size=2 pad=1_1 rhs_reversal=1}, "
            "dim_labels=bf0_i0o->b0f")
    types = {"%x": "bf16[2048,64,1]", "%w": "bf16[64,2,32]"}
    [ins] = pe.computations(_module([line]))[0]["%main"]
    assert pe._flops(ins, types) == 2 * (2048 * 2 * 32) * 64


def test_a_layer_of_a_stacked_buffer_costs_the_layer_not_the_stack():
    """A scanned layer stack is read one layer per trip (a fusion of a ``dynamic-slice``) and
    its gradient written one layer per trip, in place (a fusion whose root is a
    ``dynamic-update-slice`` of its buffer parameter): each moves one layer's bytes, not the
    stack's 32; an op that reads the whole stack still costs all of it."""
    stack, layer = "f32[32,256,1024]", "f32[256,1024]"  # 32 MiB and 1 MiB
    fused = (
        f"%read (s: {stack}, i: s32[]) -> {layer} {{\n"
        f"  %s = {stack} parameter(0)\n  %i = s32[] parameter(1)\n  %z = s32[] constant(0)\n"
        f"  %ds = f32[1,256,1024] dynamic-slice(%s, %i, %z, %z), "
        f"dynamic_slice_sizes={{1,256,1024}}\n"
        f"  ROOT %b = {layer} bitcast(%ds)\n}}\n\n"
        f"%write (s: {stack}, i: s32[], g: bf16[256,1024]) -> {stack} {{\n"
        f"  %s = {stack} parameter(0)\n  %i = s32[] parameter(1)\n"
        f"  %g = bf16[256,1024] parameter(2)\n  %z = s32[] constant(0)\n"
        f"  %c = {layer} convert(%g)\n  %b = f32[1,256,1024] bitcast(%c)\n"
        f"  ROOT %dus = {stack} dynamic-update-slice(%s, %b, %i, %z, %z)\n}}\n\n"
        f"%sum (s: {stack}) -> {stack} {{\n"
        f"  %s = {stack} parameter(0)\n  ROOT %m = {stack} multiply(%s, %s)\n}}\n\n")
    ops = [f"%st = {stack} parameter(0)", "%i = s32[] parameter(1)",
           "%g = bf16[256,1024] parameter(2)", "%l = f32[1,256,1024] parameter(3)",
           f"%r = {layer} fusion(%st, %i), kind=kLoop, calls=%read",
           f"%w = {stack} fusion(%st, %i, %g), kind=kLoop, calls=%write",
           # XLA:GPU's asynchronous form of the same fusion (a rematerialised layer's
           # activations written into their stack on another stream)
           f"%ws = (({stack}, s32[], bf16[256,1024]), {stack}, u32[]) fusion-start(%st, %i, %g),"
           " kind=kLoop, calls=%write",
           f"%all = {stack} fusion(%st), kind=kLoop, calls=%sum",
           f"%u = {stack} dynamic-update-slice(%st, %l, %i, %i, %i)",
           "%d = f32[1,256,1024] dynamic-slice(%st, %i, %i, %i), "
           "dynamic_slice_sizes={1,256,1024}"]
    comps, entry = pe.computations(_module(ops, extra=fused))
    costs = pe._Costs(comps, CHIP)
    types = {i.name: i.type for i in comps[entry]}
    moved = {i.name: costs.bytes_moved(i, types) for i in comps[entry] if i.op != "parameter"}
    mib = 2**20
    assert moved["%r"] == 2 * mib + 4  # the layer read and written, and the index
    assert moved["%w"] == 0.5 * mib + mib + 4  # bf16 update read, f32 layer written in place
    assert moved["%ws"] == moved["%w"]
    assert moved["%all"] == 2 * 32 * mib  # a whole-stack op reads and writes the stack
    assert moved["%u"] == moved["%d"] == 2 * mib  # unfused: the layer, read and written


def test_a_slice_of_a_combined_buffer_costs_the_slice():
    """XLA:GPU reduces many gradients as one combined all-reduce and slices each out of its
    result (a fusion of a static ``slice``): each slice reads its own bytes, not the buffer."""
    combined, part = "bf16[33554432]", "bf16[1048576]"  # 64 MiB and 2 MiB
    fused = (f"%cut (s: {combined}) -> {part} {{\n  %s = {combined} parameter(0)\n"
             f"  ROOT %sl = {part} slice(%s), slice={{[1048576:2097152]}}\n}}\n\n")
    ops = [f"%buf = {combined} parameter(0)",
           f"%a = {part} fusion(%buf), kind=kLoop, calls=%cut",
           f"%b = {part} slice(%buf), slice={{[0:1048576]}}"]
    comps, entry = pe.computations(_module(ops, extra=fused))
    costs = pe._Costs(comps, CHIP)
    types = {i.name: i.type for i in comps[entry]}
    moved = {i.name: costs.bytes_moved(i, types) for i in comps[entry] if i.op != "parameter"}
    assert moved == {"%a": 4 * 2**20, "%b": 4 * 2**20}  # 2 MiB read, 2 MiB written


def test_compute_by_op_adds_up_and_two_steps_compare_op_by_op(tmp_path):
    """Every op's compute lands under one label (kind and layout-free type; ``matmul`` where it
    does FLOPs), loops times their trips; ``compare`` and ``scripts/compare_pod_steps.py`` put
    two steps' labels and collectives side by side."""
    plain = _module([f"%p = {F32_1M} parameter(0)", _compute("c", "p"),
                     f"ROOT %ar = {F32_1M} all-reduce(%c), {GROUP}"])
    extra = _module([f"%p = {F32_1M} parameter(0)", _compute("c", "p"),
                     "%x = f32[512,512]{1,0} bitcast(%c)",
                     "%t = f32[512,512]{0,1} copy(%x)",
                     "%mm = f32[512,512] dot(%t, %t), lhs_contracting_dims={1}, "
                     "rhs_contracting_dims={0}",
                     f"ROOT %ar = {F32_1M} all-reduce(%c), {GROUP}"])
    a, b = (pe.replay(h, 0.0, CHIP, mesh=None) for h in (plain, extra))
    assert sum(b.compute_by_op.values()) == pytest.approx(b.compute_s)
    assert set(b.compute_by_op) == {"multiply f32[262144]", "copy f32[512,512]",
                                    "matmul dot f32[512,512]"}
    table = pe.compare(a, b)
    assert "| `copy f32[512,512]` | 0.00 | 2.10 | 2.10 |" in table
    assert "| all-reduce, ICI | 1.57 | 1.57 | 1.57 | 1.57 |" in table
    paths = []
    for name, text in (("a", plain), ("b", extra)):
        paths.append(tmp_path / f"{name}.hlo.txt")
        paths[-1].write_text(text)
    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "compare_pod_steps.py"
    out = subprocess.run([sys.executable, str(script), *map(str, paths), "--chip", "v5e"],
                         capture_output=True, text=True, check=True).stdout
    assert "`copy f32[512,512]`" in out and "| compute ms |" in out
    bad = subprocess.run([sys.executable, str(script), *map(str, paths), "--chip", "v4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: no published bandwidths for TPU 'v4'")


def test_each_row_names_its_hlo_file():
    row = {"mode": "fp8", "mesh": "4x16x1", "reduction": "flat, in backward, ppermute",
           "variant": "ordinary", "flags": "xla_jf_spmd_threshold_for_windowed_einsum_mib=1"}
    assert pod.hlo_file_name(row) == ("fp8_4x16x1_flat_in_backward_ppermute_ordinary_"
                                      "xla_jf_spmd_threshold_for_windowed_einsum_mib=1.hlo.txt")


def test_cudnn_flash_attention_costs_its_matmuls():
    """A cuDNN flash-attention call is a custom call whose score matrix never reaches HBM: its
    FLOPs come from the call's intermediate shape (forward 4·B·H·T·S·D, backward 10·…,
    halved by a causal mask), at the tensor cores' rate for its dtype (GPU: bf16 twice f32)."""
    config = ('"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "20", '
              '"2048", "2048"], "tuple_shapes": []}, "is_flash_attention": true, '
              '"mask_type": "CAUSAL"')
    q = "bf16[2,2048,20,64]"
    ops = [f"%q = {q} parameter(0)",
           f'%fwd = ({q}, f32[2,20,2048]) custom-call(%q, %q, %q), '
           f'custom_call_target="__cudnn$fmhaSoftmax", backend_config={{{config}}}',
           f'%bwd = ({q}, {q}, {q}) custom-call(%q, %q, %q), '
           f'custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={{{config}}}']
    comps, entry = pe.computations(_module(ops))
    cluster = pe.GpuCluster(1e12, 2e12, 1e15, 1e11, 1e10, "net", "test")
    costs = pe._Costs(comps, cluster)
    types = {i.name: i.type for i in comps[entry]}
    fwd, bwd = (next(i for i in comps[entry] if i.name == n) for n in ("%fwd", "%bwd"))
    flops = 4 * 2 * 20 * 2048 * 2048 * 64 / 2
    assert costs.roofline(fwd, types) == pytest.approx((flops / 1e12, flops))
    assert costs.roofline(bwd, types) == pytest.approx((2.5 * flops / 1e12, 2.5 * flops))
