"""`pipectl validate`: measured runs read by header, predicted with their layout pinned, and summarised."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest

from pipectl.errors import UserInputError
from pipectl.measured.runs import load_conditions, parse_runs
from pipectl.measured.summary import ranks, regret, spearman

HEADER = (
    "# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
    "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)"
)
# One shape on 8 GPUs at one global batch, four layouts; and one row of another group. The times are
# of the right order for these shapes on A100s; the tests check what validate computes from them.
ROWS = [
    "8,32,4,1024,16,12,1024,2,2,2,120.0",
    "8,32,4,1024,16,12,1024,1,8,1,95.0",
    "8,32,2,1024,16,12,1024,8,1,1,160.0",
    "8,32,1,1024,16,12,1024,1,2,4,140.0",
    "2,8,2,1024,16,12,1024,1,1,2,110.0",
]
CONDITIONS = """\
source: a test cluster
device: a100-80gb
devices_per_node: 8
links:
  intra_node_gbytes_per_second: 150
  inter_node_gbits_per_second_per_node: 800
framework: megatron-deepspeed
schedule: 1f1b
recompute: full
gradient_reduce_overlap: false
attention: unfused
vocab: 50257
tied_embeddings: true
vocab_parallel: true
dropout: 0.1
precision: fp16
zero_stage: 0
"""


def pipectl(cwd, *args):
    return subprocess.run([sys.executable, "-m", "pipectl", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture()
def measured(tmp_path):
    (tmp_path / "runs.csv").write_text("\n".join([HEADER, *ROWS]) + "\n")
    (tmp_path / "conditions.yaml").write_text(CONDITIONS)
    return tmp_path


def test_validate_predicts_every_row_and_summarises_from_a_working_directory(measured):
    result = pipectl(measured, "validate", "runs.csv", "--conditions", "conditions.yaml", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = report["rows"]
    assert [r["line"] for r in rows] == [2, 3, 4, 5, 6]
    for row in rows:
        assert row["predicted_seconds"] > 0 and row["problem"] is None
        assert row["error"] == pytest.approx(row["predicted_seconds"] / row["measured_seconds"] - 1)
    errors = sorted(abs(r["error"]) for r in rows)
    assert report["summary"]["rows"] == 5
    assert report["summary"]["max_abs_error"] == pytest.approx(errors[-1])
    assert report["summary"]["median_abs_error"] == pytest.approx(errors[2])
    group = next(g for g in report["groups"] if g["rows"] == 4)
    members = [r for r in rows if r["group"] == group["key"]]
    predicted = [r["predicted_seconds"] for r in members]
    measured_times = [r["measured_seconds"] for r in members]
    assert group["spearman"] == pytest.approx(spearman(predicted, measured_times))
    assert group["regret"] == pytest.approx(regret(predicted, measured_times))
    assert group["best_measured"] == "t1 d8 p1 b4"

    table = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml")
    assert table.returncode == 0, table.stderr
    assert "5 of 5 runs predicted: median |error|" in table.stdout
    assert "Spearman" in table.stdout and "t1 d8 p1 b4" in table.stdout
    assert "step time per run, ms" in table.stdout and "largest errors" not in table.stdout  # all 5 shown


def test_a_row_column_overrides_the_conditions(measured):
    (measured / "runs.csv").write_text(HEADER + ",recompute\n" + ROWS[0] + ",none\n" + ROWS[0] + ",full\n")
    result = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml", "--json")
    assert result.returncode == 0, result.stderr
    without, with_recompute = (r["predicted_seconds"] for r in json.loads(result.stdout)["rows"])
    assert with_recompute > without  # full recomputation runs every forward twice


@pytest.mark.parametrize(
    "csv_text, conditions, message",
    [
        (HEADER.replace(",iteration time (ms)", "") + "\n1,2\n", CONDITIONS, "no column 'iteration time (ms)'"),
        (HEADER + "\n" + ROWS[0].replace("2,2,2,120.0", "2,2,1,120.0") + "\n", CONDITIONS, "not the row's 8 GPUs"),
        (HEADER + "\n" + ROWS[0].replace("120.0", "fast") + "\n", CONDITIONS, "line 2: 'iteration time (ms)' is 'fast'"),
        # A step too short to be one (its relative error would overflow to infinity in the JSON).
        (HEADER + "\n" + ROWS[0].replace("120.0", "1e-300") + "\n", CONDITIONS,
         "line 2: 'iteration time (ms)' is '1e-300': no training step takes under a microsecond"),
        (HEADER + "\n" + ROWS[0] + "\n", CONDITIONS + "pipeline_flush: true\n", "pipeline_flush"),
        (HEADER + "\n" + ROWS[0] + "\n", CONDITIONS.replace("fp16", "fp8"), "precision"),
        (HEADER + ",schedule\n" + ROWS[0] + ",foo\n", CONDITIONS, "line 2: schedule 'foo' is not one of 1f1b, gpipe"),
        (HEADER + ",device\n" + ROWS[0] + ",h900\n", CONDITIONS, "runs.csv line 2: device: unknown device kind 'h900'"),
        (HEADER + "\n" + ROWS[0] + "\n", CONDITIONS.replace("a100-80gb", "h900"), "conditions.yaml: device: unknown device kind 'h900'"),
        (HEADER + "\n" + ROWS[0] + "\n", CONDITIONS.replace("megatron-deepspeed", "megatron_deepspeed"), "framework"),
        (HEADER + "\n" + ROWS[0].replace(",1024,16,", ",1000,16,") + "\n", CONDITIONS, "not a multiple of its 16"),
        (HEADER + ",# GPUs\n" + ROWS[0] + ",4\n", CONDITIONS, "two columns named '# gpus'"),
        # A cell beyond what a model or request may hold is named by its column, not by a field of pipectl's.
        (HEADER + "\n" + ROWS[0].replace("8,32,", "8,3000000000,", 1) + "\n", CONDITIONS,
         "runs.csv line 2: 'global batch': Input should be less than or equal to 2147483648 (got 3000000000)"),
        (HEADER + "\n" + ROWS[0].replace(",16,12,", ",16,100000000,") + "\n", CONDITIONS,
         "runs.csv line 2: '# layers': Input should be less than or equal to 10000 (got 100000000)"),
        (HEADER + "\n" + ROWS[0].replace("120.0", "120,5") + "\n", CONDITIONS, "line 2: 12 values, the header names 11"),
        (HEADER + "\n" + ROWS[0] + "\n", CONDITIONS.replace("precision: fp16", "precision: fp16\nprecision: bf16"),
         "the key 'precision' is written twice"),
        (HEADER + "\n" + ROWS[0] + "\n", CONDITIONS.replace("vocab:", "vocab_size:"), "vocab_size: unknown key; did you mean vocab?"),
        (HEADER + "\n" + ROWS[0] + "\n", "sorce: x\n" + CONDITIONS, "sorce: unknown key; did you mean source?"),
        # A file that is not comma-separated, or whose first line is no header, says so (not 11 missing columns).
        (HEADER.replace(",", ";") + "\n" + ROWS[0].replace(",", ";") + "\n", CONDITIONS,
         "runs.csv line 1 is not the header of measured runs: its columns are separated by ';', not commas"),
        ("# runs of May\n" + HEADER + "\n" + ROWS[0] + "\n", CONDITIONS,
         "runs.csv line 1 is not the header of measured runs: it names none of their columns"),
        # YAML's booleans are no numbers, and a figure beyond what a model or cluster holds names the
        # conditions' field, not a row of the CSV.
        (HEADER + "\n" + ROWS[0] + "\n", CONDITIONS.replace("vocab: 50257", "vocab: true"),
         "conditions.yaml: vocab: true is a boolean, not a number"),
        (HEADER + "\n" + ROWS[0] + "\n", CONDITIONS.replace("devices_per_node: 8", "devices_per_node: 100000000"),
         "conditions.yaml: devices_per_node: Input should be less than or equal to 4096"),
        (HEADER + "\n" + ROWS[0] + "\n", CONDITIONS.replace("intra_node_gbytes_per_second: 150", "intra_node_gbytes_per_second: .inf"),
         "conditions.yaml: links.intra_node_gbytes_per_second: Input should be a finite number"),
        (HEADER + "\n" + ROWS[0] + "\n",
         CONDITIONS.replace("inter_node_gbits_per_second_per_node: 800", "inter_node_gbits_per_second_per_node: 1.0e-5"),
         "conditions.yaml: links.inter_node_gbits_per_second_per_node 1e-05 over 8 GPUs a node is 1.56e-07 GB/s a GPU"),
        # Another pipectl file in its place is named as what it is, not as 14 missing and unknown keys.
        (HEADER + "\n" + ROWS[0] + "\n", '{"schema_version": 1, "uncalibrated": {}, "terms": {}}',
         "conditions.yaml is a calibration (pipectl calibrate MEASURED.csv), not a conditions file"),
    ],
)
def test_bad_input_is_one_line_naming_the_value(measured, csv_text, conditions, message):
    (measured / "runs.csv").write_text(csv_text)
    (measured / "conditions.yaml").write_text(conditions)
    result = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml")
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_headers_are_read_by_name_in_any_order_and_case():
    text = (
        "Iteration Time (ms),pipeline parallelism,data parallelism,tensor parallelism,sequence length,# Layers,"
        "attention heads,hidden size,micro batch,global batch,# GPUs,Parameters (billion),notes\n"
        "120.0,2,2,2,1024,12,16,1024,4,32,8,0.35,first run\n"
    )
    [run] = parse_runs(io.StringIO(text), source="log.csv")
    assert (run.tensor_parallel, run.data_parallel, run.pipeline_parallel, run.micro_batch) == (2, 2, 2, 4)
    assert run.measured_seconds == pytest.approx(0.12) and run.parameters_billion == pytest.approx(0.35)


def test_unknown_condition_fields_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONDITIONS + "overlap_everything: true\n")
    with pytest.raises(UserInputError, match="overlap_everything"):
        load_conditions(path)


def test_a_file_with_a_byte_order_mark_reads_as_one_without(measured):
    (measured / "runs.csv").write_bytes(b"\xef\xbb\xbf" + ("\n".join([HEADER, ROWS[-1]]) + "\n").encode())
    result = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["summary"]["rows"] == 1


def test_ties_for_fastest_count_the_slower_and_the_best_includes_unpredicted_rows():
    from pipectl.measured.predict import Prediction
    from pipectl.measured.runs import MeasuredRun
    from pipectl.measured.summary import summarise_groups

    def run(line, t, measured):
        return MeasuredRun(line, 8, 32, 4, 1024, 16, 12, 1024, t, 8 // t, 1, measured)

    predictions = [
        Prediction(run(2, 1, 0.10), 0.05), Prediction(run(3, 2, 0.12), 0.05),  # tied fastest
        Prediction(run(4, 4, 0.09), None, problem="cannot plan"),  # the best measured, not predicted
    ]
    [group] = summarise_groups(predictions)
    assert group.ranked_first == "t2 d4 p1 b4" and group.best_measured == "t4 d2 p1 b4"
    assert group.regret == pytest.approx(0.12 / 0.09 - 1) and group.unpredicted == 1 and group.rows == 2


def test_ranks_share_ties_and_spearman_is_undefined_without_spread():
    assert spearman([1.0, 1.0, 2.0, 3.0], [4.0, 3.0, 3.0, 1.0]) == pytest.approx(-5 / 6)
    assert ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert spearman([1.0, 1.0], [2.0, 3.0]) is None
    assert spearman([1.0], [2.0]) is None
    assert regret([2.0, 1.0], [10.0, 11.0]) == pytest.approx(0.1)


def _additive_rows(block_step=lambda d: 0.5 + 0.1 * d) -> list[str]:
    """Rows of one shape at t = 1, b = 2 whose steps are exact sums of known parts (ms): 4 per block
    and micro-batch, 9 per micro-batch, `block_step(d)` per block and step, 3 per step."""
    rows = []
    for layers in (12, 24):
        for micro_batches in (2, 4):
            for d in (2, 4):
                step = micro_batches * layers * 4 + micro_batches * 9 + layers * block_step(d) + 3
                rows.append(f"{d},{micro_batches * 2 * d},2,1024,16,{layers},1024,1,{d},1,{step}")
    return rows


def test_split_shows_where_the_measured_and_predicted_steps_go(measured):
    (measured / "runs.csv").write_text("\n".join([HEADER, *_additive_rows(), ROWS[0]]) + "\n")
    report = json.loads(pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml", "--json").stdout)
    (split,) = report["time_split"]  # the p = 2 row forms no group
    assert split["key"] == "h1024 a16 s1024 t1 b2" and split["rows"] == 8
    parts = split["measured"]
    assert parts["block_micro_batch_seconds"] == pytest.approx(4e-3)
    assert parts["micro_batch_seconds"] == pytest.approx(9e-3)
    assert parts["block_step_seconds"] == pytest.approx({"d2": 0.7e-3, "d4": 0.9e-3})
    assert parts["step_seconds"] == pytest.approx({"d2": 3e-3, "d4": 3e-3})
    assert split["largest_residual"] < 1e-9
    # The predicted steps split the same way: their block part is the model's block.
    assert 1e-3 < split["predicted"]["block_micro_batch_seconds"] < 10e-3

    table = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml", "--split")
    assert table.returncode == 0, table.stderr
    assert "where a step's time goes" in table.stdout
    # One line per d: the parts every d shares on the first, a block's share of the end of the step on each.
    assert re.search(r"h1024 a16 s1024 t1 b2\s+2\s+4\.00 / [\d.]+\s+9\.00 / [\d.]+\s+0\.70 / [\d.]+ *\n\s+4\s+0\.90 / ",
                     table.stdout)
    assert "where a step's time goes" not in pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml").stdout


def test_rows_whose_end_of_step_falls_with_d_are_said_to_split_the_optimizer(measured):
    """A block's end-of-step share that falls as d grows cannot be ZeRO stage 0's: validate says so."""
    falling = _additive_rows(block_step=lambda d: 0.9 - 0.1 * d)  # 0.7 ms at d = 2, 0.5 at d = 4
    (measured / "runs.csv").write_text("\n".join([HEADER, *falling]) + "\n")
    result = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml")
    assert result.returncode == 0, result.stderr
    assert ("note: a block's share of the end of the step falls as d grows (h1024 a16 s1024 t1 b2: 0.70 ms at "
            "d = 2, 0.50 ms at d = 4)") in result.stdout
    assert json.loads(pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml", "--json").stdout)["notes"]
    # Rows that say their stage (1), or rows whose share grows with d: nothing to say.
    (measured / "runs.csv").write_text(HEADER + ",zero stage\n" + "\n".join(row + ",1" for row in falling) + "\n")
    assert "note:" not in pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml").stdout
    (measured / "runs.csv").write_text("\n".join([HEADER, *_additive_rows()]) + "\n")
    assert "note:" not in pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml").stdout


def test_megatron_deepspeeds_rows_are_priced_with_its_own_layer(tmp_path):
    """Rows run by Megatron-DeepSpeed take its layer's kernels and blocking copies
    (`EngineFeatures.megatron_deepspeed_layer`); Megatron-LM's rows do not: another code base."""
    from pipectl.measured.predict import engine_features

    path = tmp_path / "conditions.yaml"
    path.write_text(CONDITIONS)
    conditions = load_conditions(path)
    assert engine_features(conditions.model_copy(update={"framework": "megatron-deepspeed"})).megatron_deepspeed_layer
    assert not engine_features(conditions.model_copy(update={"framework": "megatron-lm"})).megatron_deepspeed_layer
    from pipectl.artifacts.profile import EngineFeatures

    assert not EngineFeatures(name="megatron-deepspeed", megatron_deepspeed_layer=True).runnable_by_pipectl


def test_the_conditions_link_prices_transfers_and_nccls_figure_the_collectives(tmp_path):
    """A GPU-to-GPU figure is not an all-reduce's bus bandwidth: collectives inside a node take the
    conditions' own all-reduce figure where they state one, else the catalog's measured one (A100:
    230 GB/s), and transfers the stated link."""
    path = tmp_path / "conditions.yaml"
    path.write_text(CONDITIONS)
    links = load_conditions(path).cluster_links()
    assert links["intra_node_bandwidth_gbytes_per_second"] == 150
    assert links["intra_node_allreduce_bandwidth_gbytes_per_second"] == 230
    # A row on another device (its `device` column) takes that device's figure (H100: 370 GB/s).
    assert load_conditions(path).cluster_links("h100-80gb")["intra_node_allreduce_bandwidth_gbytes_per_second"] == 370
    path.write_text(CONDITIONS.replace("  inter_node_gbits", "  intra_node_allreduce_gbytes_per_second: 180\n  inter_node_gbits"))
    assert load_conditions(path).cluster_links()["intra_node_allreduce_bandwidth_gbytes_per_second"] == 180
    path.write_text(CONDITIONS.replace("  intra_node_gbytes_per_second: 150\n", ""))
    assert "intra_node_allreduce_bandwidth_gbytes_per_second" not in load_conditions(path).cluster_links()


def test_rows_that_cannot_be_predicted_are_each_named_and_no_empty_table_is_printed(measured):
    """A pipeline deeper than the model: the row's reason, not a table of "the 0 largest errors", and
    exit 2 (nothing predicted: nothing validated; it used to exit 0), in JSON too. A row no engine
    can have run (B not a multiple of b x d) is refused as the file is read, naming it."""
    (measured / "deep.csv").write_text(HEADER + "\n8,32,4,1024,16,2,1024,1,1,8,120.0\n")
    done = pipectl(measured, "validate", "deep.csv", "--conditions", "conditions.yaml", "--json")
    assert done.returncode == 2 and json.loads(done.stdout)["summary"]["rows"] == 0, done.stdout + done.stderr
    (measured / "odd.csv").write_text(HEADER + "\n2,15,8,1024,16,24,1024,1,1,2,300\n")
    odd = pipectl(measured, "validate", "odd.csv", "--conditions", "conditions.yaml")
    assert odd.returncode == 2 and odd.stdout == "", odd.stdout
    assert odd.stderr.strip() == ("error: odd.csv line 2: global batch 15 is not a multiple of micro batch x data "
                                  "parallelism = 8 x 1 = 8"), odd.stderr
    done = pipectl(measured, "validate", "deep.csv", "--conditions", "conditions.yaml")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: no row of deep.csv could be predicted"), done.stderr
    assert "no run of 1 could be predicted" in done.stdout and "largest errors" not in done.stdout, done.stdout
    assert "line 2: not predicted: pipeline-parallel degree 8 exceeds the model's" in " ".join(done.stdout.split())


def test_a_split_is_shown_only_where_the_rows_determine_it():
    """Two rows of one d against four parts used to give a least-squares split with a negative part
    (a minimum-norm answer, any of many), with a residual of zero that read as a perfect fit."""
    from pipectl.measured.runs import MeasuredRun
    from pipectl.measured.summary import Prediction, time_split

    def run(m: int, layers: int, d: int) -> MeasuredRun:
        return MeasuredRun(line=0, gpus=d, global_batch=m * d, micro_batch=1, hidden=1024, heads=16, layers=layers,
                           seq_len=1024, tensor_parallel=1, data_parallel=d, pipeline_parallel=1,
                           measured_seconds=m * layers * 3e-3 + m * 7e-3 + layers * 5e-4 + 2e-3)  # fmt: skip

    two = [run(2, 12, 4), run(4, 24, 4)]
    assert time_split([Prediction(r, r.measured_seconds) for r in two]) == []
    four = [*two, run(2, 24, 4), run(4, 12, 4)]
    (split,) = time_split([Prediction(r, r.measured_seconds) for r in four])
    assert round(split.measured.block_micro_batch, 6) == 3e-3 and round(split.measured.micro_batch, 6) == 7e-3



def test_times_in_seconds_under_the_milliseconds_header_are_pointed_out(measured):
    """A log exported in seconds reads as runs 1000x faster than predicted: every row's error is
    about -100 %, and the figures alone do not say why; a note names the column's unit."""
    in_seconds = [",".join([*row.split(",")[:-1], str(float(row.split(",")[-1]) / 1e3)]) for row in ROWS]
    (measured / "runs.csv").write_text("\n".join([HEADER, *in_seconds]) + "\n")
    result = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml")
    assert result.returncode == 0, result.stderr
    assert "below their predictions: is the column 'iteration time (ms)' in milliseconds?" in result.stdout
    (measured / "runs.csv").write_text("\n".join([HEADER, *ROWS]) + "\n")
    right = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml", "--json")
    assert not any("milliseconds" in note for note in json.loads(right.stdout)["notes"])


def test_layouts_refused_by_memory_that_fit_a_higher_zero_stage_point_at_the_conditions(measured):
    """A 3.56 B-parameter GPT at t1 d64 ran on 80 GB A100s; under ZeRO-0 fp16 the memory model refuses
    it (DeepSpeed's 16-bit step holds 24 bytes a parameter: 85 GB). validate still predicts its step,
    and says that it fits under ZeRO stage 1, whose optimizer state is split over d: the conditions'
    stage is the suspect. The same model on one GPU fits under no stage: no stage to suggest."""
    rows = ["64,128,1,3072,32,30,2048,1,64,1,3000.0", "1,8,1,3072,32,30,2048,1,1,1,20000.0"]
    (measured / "runs.csv").write_text("\n".join([HEADER, *rows]) + "\n")
    result = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml")
    assert result.returncode == 0, result.stderr
    assert "the memory model refuses 2 of the layouts that ran" in result.stdout
    assert "note: 1 of the 2 layouts the memory model refuses fits under ZeRO stage 1 (line 2)" in result.stdout
    rows = json.loads(pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml", "--json").stdout)["rows"]
    assert [(r["predicted_seconds"] is not None, r["fits_with_zero_stage"]) for r in rows] == [(True, 1), (True, None)]
    assert all(r["memory_refused"] for r in rows)


def test_blank_lines_before_the_header_a_device_in_capitals_and_yaml_numbers_are_read(measured):
    (measured / "runs.csv").write_text("\n\n" + "\n".join([HEADER, *ROWS]) + "\n")
    # `1e-1` is a string to YAML 1.1 and `8.0` a float: both numbers a user means.
    (measured / "conditions.yaml").write_text(CONDITIONS.replace("a100-80gb", "A100-80GB").replace(
        "dropout: 0.1", "dropout: 1e-1").replace("devices_per_node: 8", "devices_per_node: 8.0"))
    result = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["summary"]["rows"] == len(ROWS)
