"""The device catalog: shipped datasheets, efficiency curves, look-ups."""

from __future__ import annotations

import pytest
import yaml

from pipectl.catalog import DeviceSpec, get_device, load_catalog
from pipectl.errors import ArtifactError, UserInputError

REQUIRED = [
    "k80", "p100", "v100-16gb", "v100-32gb", "t4", "a10",
    "a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie", "h200", "mi250x-gcd", "mi300x", "cpu",
]


def _device(**overrides) -> DeviceSpec:
    fields = dict(
        name="test-gpu",
        memory_gib=16,
        peak_tflops_bf16=100,
        peak_tflops_fp32=10,
        intra_node_bandwidth_gbytes_per_second=100,
        intra_node_latency_us=5,
        inter_node_bandwidth_gbytes_per_second=10,
        inter_node_latency_us=10,
        efficiency_by_micro_batch=[(1, 0.2), (4, 0.5)],
    )
    fields.update(overrides)
    return DeviceSpec(**fields)


@pytest.mark.parametrize("name", REQUIRED)
def test_required_device_present_with_positive_figures(name):
    device = load_catalog()[name]
    assert device.name == name
    for figure in (
        device.memory_gib,
        device.peak_tflops_bf16,
        device.peak_tflops_fp32,
        device.intra_node_bandwidth_gbytes_per_second,
        device.inter_node_bandwidth_gbytes_per_second,
    ):
        assert figure > 0
    assert device.intra_node_latency_us >= 0 and device.inter_node_latency_us >= 0
    assert device.peak_tflops_bf16 >= device.peak_tflops_fp32 or name == "cpu"
    assert device.source, f"{name} does not say where its figures come from"


@pytest.mark.parametrize("name", REQUIRED)
def test_efficiency_never_falls_with_micro_batch(name):
    device = get_device(name)
    values = [device.efficiency(b) for b in range(1, 65)]
    assert all(0 < v <= 1 for v in values)
    assert values == sorted(values)


def test_datasheet_figures_of_a_few_devices():
    # NVIDIA datasheets: A100 312 dense bf16 TFLOP/s, H100 SXM 989, V100 125 fp16 tensor.
    assert get_device("a100-80gb").peak_flops_per_second("bfloat16") == 312e12
    assert get_device("a100-80gb").peak_flops_per_second("float32") == 19.5e12
    assert get_device("h100-80gb").peak_tflops_bf16 == 989
    assert get_device("v100-16gb").memory_bytes == 16 * 1024**3
    assert get_device("h200").memory_gib > get_device("h100-80gb").memory_gib
    # H100 PCIe 756 dense bf16 (1,513 with sparsity); MI300X 1,307.4, 192 GB; MI250X 383 per module
    # of two GCDs, 128 GB: per GCD half of each.
    assert get_device("h100-pcie").peak_tflops_bf16 == 756 and get_device("h100-pcie").memory_gib == 80
    assert get_device("mi300x").peak_tflops_bf16 == 1307.4 and get_device("mi300x").memory_gib == 192
    assert get_device("mi250x-gcd").peak_tflops_bf16 == 383 / 2 and get_device("mi250x-gcd").memory_gib == 128 / 2


def test_estimated_sustained_gemm_rates_stay_below_the_measured_bursts():
    # Each gemm_efficiency sits under the best matmul burst measured on one such device (the
    # catalog's sources): a loaded GPU at its power limit holds a lower clock.
    bursts = {"a100-80gb": 271.2 / 312, "h100-80gb": 794.5 / 989, "mi300x": 668.4 / 1300, "mi250x-gcd": 147.0 / 191.5}
    for name, burst in bursts.items():
        device = get_device(name)
        assert 0.85 * burst < device.gemm_efficiency < burst, name
        assert device.attention_efficiency < device.gemm_efficiency, name
    # The PCIe card: the same die as the SXM one under a lower power limit, so a lower rate.
    assert get_device("h100-pcie").gemm_efficiency < get_device("h100-80gb").gemm_efficiency


def test_efficiency_interpolates_linearly_and_is_flat_beyond_the_ends():
    device = _device(efficiency_by_micro_batch=[(2, 0.2), (4, 0.5), (8, 0.6)])
    assert device.efficiency(1) == pytest.approx(0.2)
    assert device.efficiency(2) == pytest.approx(0.2)
    assert device.efficiency(3) == pytest.approx(0.35)
    assert device.efficiency(6) == pytest.approx(0.55)
    assert device.efficiency(8) == pytest.approx(0.6)
    assert device.efficiency(1024) == pytest.approx(0.6)
    assert device.achievable_flops_per_second("bfloat16", 3) == pytest.approx(100e12 * 0.35)


@pytest.mark.parametrize(
    "curve",
    [[(4, 0.5), (1, 0.2)], [(1, 0.2), (1, 0.3)], [(1, 1.5)], [(0, 0.5)], [(1, 0.0)]],
)
def test_malformed_efficiency_curve_is_rejected(curve):
    with pytest.raises(ValueError):
        _device(efficiency_by_micro_batch=curve)


def test_unknown_fields_are_rejected():
    with pytest.raises(ValueError, match="peak_tflops"):
        _device(peak_tflops=3)


def test_unknown_device_names_the_kind_and_lists_known_ones():
    with pytest.raises(UserInputError) as info:
        get_device("a100-81gb")
    assert "a100-81gb" in info.value.message
    assert "a100-80gb" in info.value.hint and "cpu" in info.value.hint


def test_unknown_dtype_is_a_user_error():
    with pytest.raises(UserInputError, match="int8"):
        get_device("cpu").peak_flops_per_second("int8")


def test_catalog_file_with_repeated_names_is_an_artifact_error(tmp_path):
    entry = _device().model_dump()
    path = tmp_path / "devices.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "devices": [entry, entry]}))
    with pytest.raises(ArtifactError, match="test-gpu"):
        load_catalog(path)


def test_catalog_follows_the_configs_override(tmp_path, monkeypatch):
    path = tmp_path / "devices.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "devices": [_device().model_dump()]}))
    monkeypatch.setenv("PIPECTL_CONFIGS", str(tmp_path))
    assert list(load_catalog()) == ["test-gpu"]


COMPUTE = dict(multiprocessors=100, gemm_efficiency=0.8, attention_efficiency=0.4, kernel_overhead_us=10,
               memory_bandwidth_gbytes_per_second=1000)


def test_compute_model_needs_every_constant():
    assert _device(**COMPUTE).has_compute_model()
    for missing in COMPUTE:
        assert not _device(**{k: v for k, v in COMPUTE.items() if k != missing}).has_compute_model(), missing


@pytest.mark.parametrize("field, value", [("gemm_efficiency", 1.2), ("attention_efficiency", 0), ("multiprocessors", 0),
                                          ("kernel_overhead_us", -1)])
def test_impossible_compute_constants_are_rejected(field, value):
    with pytest.raises(ValueError):
        _device(**{**COMPUTE, field: value})


def test_shipped_gpus_carry_compute_constants_from_their_datasheets():
    sms = {"p100": 56, "v100-16gb": 80, "v100-32gb": 80, "a100-40gb": 108, "a100-80gb": 108, "h100-80gb": 132,
           "h100-pcie": 114, "h200": 132, "mi250x-gcd": 110, "mi300x": 304}
    for name, count in sms.items():
        device = get_device(name)
        assert device.has_compute_model() and device.multiprocessors == count, name
        assert device.attention_efficiency <= device.gemm_efficiency, name
    assert not get_device("cpu").has_compute_model()
