"""Meshes (:mod:`gift_jax.training.mesh`): one free size fills the rest, sizes that cannot
multiply to the devices are refused naming the settings, the axes are named and typed as the
sharded step expects, and data, model and batch axes are read off them."""

import jax
import ml_collections
import pytest
from jax.sharding import AxisType

from gift_jax.training.config import nothing_to_communicate
from gift_jax.training.mesh import (
    batch_axes,
    data_axes,
    data_parallel_size,
    make_mesh,
    mesh_shape,
    model_axes,
)


@pytest.mark.parametrize("sizes,want", [
    (dict(), {"data": 8, "fsdp": 1, "tensor": 1}),
    (dict(fsdp=2, tensor=2), {"data": 2, "fsdp": 2, "tensor": 2}),
    (dict(data=2, fsdp=-1, tensor=2), {"data": 2, "fsdp": 2, "tensor": 2}),
    (dict(data=4, fsdp=2, tensor=1), {"data": 4, "fsdp": 2, "tensor": 1}),
])
def test_mesh_shape_fills_the_free_size(sizes, want):
    assert mesh_shape(8, **sizes) == want


@pytest.mark.parametrize("sizes,match", [
    (dict(data=-1, fsdp=-1), r"only one of mesh.data/fsdp/tensor may be -1"),
    (dict(fsdp=3), r"mesh.data=-1, mesh.fsdp=3, mesh.tensor=1: the fixed sizes \(3\) must "
                   r"divide the number of devices \(8\)"),
    (dict(data=2, fsdp=2, tensor=1), r"multiply to 4, not to the number of devices \(8\)"),
    (dict(tensor=0), r"mesh.tensor=0 must be a positive int or -1"),
    (dict(intra_size=3), r"mesh.intra_size=3 must divide the number of data-parallel "
                         r"replicas \(8\)"),
])
def test_mesh_shape_refusals_name_the_settings(sizes, match):
    with pytest.raises(ValueError, match=match):
        mesh_shape(8, **sizes)


def test_axes_of_the_meshes():
    flat = make_mesh()
    assert flat.axis_names == ("data",) and flat.axis_types == (AxisType.Explicit,)
    assert data_axes(flat) == ("data",) and model_axes(flat) == () and batch_axes(flat) == (
        "data",)
    hier = make_mesh(intra_size=2)
    assert dict(hier.shape) == {"data": 4, "intra": 2}
    assert data_axes(hier) == ("data", "intra")
    sharded = make_mesh(fsdp=2, tensor=2)
    assert sharded.axis_names == ("data", "fsdp", "tensor")
    assert set(sharded.axis_types) == {AxisType.Auto}  # GSPMD partitions the model axes
    assert model_axes(sharded) == ("fsdp", "tensor")
    assert batch_axes(sharded) == ("data", "fsdp")  # tensor-parallel devices share rows
    assert model_axes(make_mesh(fsdp=1, tensor=1)) == ()


def test_replicas_are_the_data_axes_not_the_devices():
    """The trainer's "nothing to communicate" warning counts data-parallel replicas: on a
    mesh of 8 devices with data=1 (fsdp × tensor = 8) no gradient reduction crosses replicas."""
    devices = jax.devices()[:8]
    assert data_parallel_size(make_mesh(devices=devices)) == 8
    assert data_parallel_size(make_mesh(2, devices)) == 8  # data × intra
    assert data_parallel_size(make_mesh(devices=devices, fsdp=4)) == 2
    sharded = make_mesh(devices=devices, fsdp=4, tensor=2)
    assert data_parallel_size(sharded) == 1
    config = ml_collections.ConfigDict({"comm": {"codec": "fp8_e4m3", "method": "none"}})
    assert "data-parallel size of 1" in nothing_to_communicate(config, data_parallel_size(sharded))
    assert nothing_to_communicate(config, data_parallel_size(make_mesh(devices=devices))) is None
