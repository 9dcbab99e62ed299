import json

import pytest
import yaml

from pipectl.artifacts import ClusterSpec, ModelConfig
from pipectl.errors import ArtifactError, UserInputError
from pipectl.io import load_model, read_mapping, write_json_atomic
from pipectl.paths import resolve_config


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(UserInputError, match="nope.yaml"):
        read_mapping(tmp_path / "nope.yaml")


def test_bad_yaml_is_an_artifact_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ArtifactError, match="not valid YAML"):
        read_mapping(path)


def test_validation_error_names_field_and_value(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: x\nfamily: gpt\nlayers: -3\nhidden: 64\n")
    with pytest.raises(ArtifactError, match=r"layers.*-3"):
        load_model(ModelConfig, path)


def test_a_missing_key_is_said_without_the_whole_file_as_its_value(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: x\nfamily: gpt\nlayers: 2\n")
    with pytest.raises(ArtifactError) as raised:
        load_model(ModelConfig, path)
    assert raised.value.message.endswith("hidden: Field required"), raised.value.message


def test_unknown_field_is_rejected_not_dropped(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: x\nfamily: gpt\nlayers: 2\nhidden: 64\nhiden: 32\n")
    with pytest.raises(ArtifactError, match="hiden"):
        load_model(ModelConfig, path)


def test_heads_must_divide_hidden(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: x\nfamily: gpt\nlayers: 2\nhidden: 64\nheads: 5\n")
    with pytest.raises(ArtifactError) as caught:
        load_model(ModelConfig, path)
    # A check of the whole file names its values: no "(top level)" or "(got {...})" around it.
    assert str(caught.value) == f"{path}: hidden 64 is not divisible by heads 5"


def test_write_json_atomic_round_trips(tmp_path):
    cluster = ClusterSpec.model_validate(
        {"name": "c", "node_types": [{"name": "n", "device": "cpu", "devices_per_node": 2, "nodes": 1}]}
    )
    out = write_json_atomic(tmp_path / "sub" / "c.json", cluster)
    assert ClusterSpec.model_validate(json.loads(out.read_text())) == cluster
    assert [p.name for p in out.parent.iterdir()] == ["c.json"]  # no temporary left behind


def test_every_shipped_model_config_validates():
    for name in ["gpt-tiny", "gpt-small", "gpt2-2.5b", "gpt3-175b", "gpt-1t", "bert-tiny", "mlp-tiny"]:
        config = load_model(ModelConfig, resolve_config(name, "models"))
        assert config.name == name


def test_unknown_shipped_name_lists_known_ones():
    with pytest.raises(UserInputError) as info:
        resolve_config("gpt-huge", "models")
    assert "gpt-huge" in info.value.message
    assert "gpt-tiny" in (info.value.hint or "")


def test_yaml_aliases_that_expand_beyond_a_million_values_are_refused_quickly(tmp_path):
    """Nine lists of nine aliases of the previous one: 9**9 (387 M) values from a 9-line file."""
    import time

    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    with pytest.raises(ArtifactError, match="aliases expand to more than 1,000,000 values"):
        read_mapping(bomb)
    assert time.monotonic() - started < 5


def test_yaml_anchors_a_user_writes_still_load(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("node: &node {gpus: 8, device: a100-80gb}\nnodes: [*node, *node, *node]\nmore: [*node]\n")
    data = read_mapping(path)
    assert data["nodes"] == [data["node"]] * 3 and data["more"] == [{"gpus": 8, "device": "a100-80gb"}]


def test_a_long_value_in_a_validation_error_is_shortened(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(json.dumps({"name": "m", "layers": list(range(10_000)), "hidden": 64, "heads": 4, "seq_len": 8, "vocab": 16}))
    with pytest.raises(ArtifactError) as caught:
        load_model(ModelConfig, path)
    assert "layers" in caught.value.message and "(got [...])" in caught.value.message
    assert len(caught.value.message) < 1000


def test_a_file_to_read_is_named_for_what_it_is(tmp_path):
    import os
    import threading

    with pytest.raises(UserInputError, match="is a directory, not a file"):
        read_mapping(tmp_path)
    with pytest.raises(UserInputError, match="cannot read .*: File name too long"):
        read_mapping(tmp_path / ("a" * 300 + ".yaml"))
    (tmp_path / "plain").write_text("x: 1\n")
    with pytest.raises(UserInputError, match="cannot read .*: Not a directory"):
        read_mapping(tmp_path / "plain" / "under.yaml")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # a pipe (`<(cat file)`) is read like a file

    def write() -> None:  # blocks until a reader opens the pipe
        with open(fifo, "w") as handle:
            handle.write('{"x": 1}')

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        assert read_mapping(fifo) == {"x": 1}
    finally:
        if writer.is_alive():  # the read failed before opening the pipe: let the writer go
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(timeout=10)


def test_a_write_the_system_refuses_names_the_file_meant_not_its_temporary():
    from pipectl.io import temporary_file

    with pytest.raises(OSError) as raised:
        temporary_file("/proc", "x.json")  # no file can be created in /proc
    assert raised.value.filename == "/proc/x.json"


def test_a_yaml_key_written_twice_is_refused_not_half_dropped(tmp_path):
    """YAML loaders keep the last of two equal keys: a conditions file with zero_stage: 0 then
    zero_stage: 1 was validated as stage 1, without a word."""
    from pipectl.io import safe_load_yaml

    with pytest.raises(yaml.YAMLError, match="the key 'zero_stage' is written twice"):
        safe_load_yaml("device: a100-80gb\nzero_stage: 0\nzero_stage: 1\n")
    with pytest.raises(yaml.YAMLError, match="the key 'hidden' is written twice"):
        safe_load_yaml("model:\n  hidden: 1\n  hidden: 2\n")
    # A merge's keys are overridden by those written beside it, as YAML means.
    assert safe_load_yaml("d: &d {x: 1, y: 2}\ne:\n  <<: *d\n  x: 3\n")["e"] == {"x": 3, "y": 2}


def test_an_unknown_key_at_any_depth_is_named_with_its_likely_spelling():
    """A cluster file's `slurm: {partiton: gpu}` said pydantic's 'Extra inputs are not permitted (got
    'gpu')'; a key of the model's own at its place is offered, wherever the key sits."""
    from pipectl.io import parse_model

    node = {"name": "a", "device": "a100-80gb", "devices_per_node": 8, "nodes": 2, "price_per_device_hour_on_demand": 1}
    for data, said in [
        ({"name": "c", "node_types": [node], "slurm": {"partiton": "gpu"}}, "slurm.partiton: unknown key; did you mean partition?"),
        ({"name": "c", "node_types": [node], "pricng": "spot"}, "pricng: unknown key; did you mean pricing?"),
        ({"name": "c", "node_types": [{**node, "xyz": 1}]}, "node_types.0.xyz: unknown key"),
    ]:
        with pytest.raises(ArtifactError) as caught:
            parse_model(ClusterSpec, {"schema_version": 1, **data}, source="c.yaml")
        assert caught.value.message == f"c.yaml: {said}"


def test_a_yaml_value_that_is_no_date_is_an_error_naming_the_file(tmp_path):
    """`when: 2024-13-01` reads as a date that is none: PyYAML raised a ValueError (a traceback)."""
    path = tmp_path / "m.yaml"
    path.write_text("name: x\nwhen: 2024-13-01\n")
    with pytest.raises(ArtifactError, match=r"m.yaml holds a value YAML cannot read: month must be in 1..12"):
        read_mapping(path)


def test_the_run_a_path_lies_in_is_found_through_a_link_and_named_without_dots(tmp_path):
    from pipectl.artifacts.run import JOB_FILE, run_holding

    run = tmp_path / "data" / "r1"
    (run / "checkpoints").mkdir(parents=True)
    (run / JOB_FILE).write_text("{}")
    (tmp_path / "link").symlink_to(run / "checkpoints")
    assert run_holding(tmp_path / "link" / ".." / "logs" / "x.json") is not None  # where the write would land: r1
    (tmp_path / "cfg").mkdir()
    assert run_holding(tmp_path / "cfg" / ".." / "data" / "r1" / "logs" / "x.json") == run
