"""`pipectl plan --recompute never|stage|layer|selective|always|auto`: what each one searches, and
what a bad value or a profile without an attention core says."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipectl.artifacts.plan import Plan
from pipectl.cli.main import app
from pipectl.io import load_model, write_json_atomic
from pipectl.testing.profiles import synthetic_profile

runner = CliRunner()


def _tight_profile(tmp_path, attention_core=(0.75, 0.1)):
    """Six blocks of long sequences on one CPU rank of 2.2 GiB at b = 4: keeping everything needs
    2.8 GiB; freeing the attention cores (three quarters of a block's saved bytes, as unfused
    attention's s x s scores are at s = 4096) needs 1.86, checkpointing every layer 1.79. The cores
    take a tenth of a block's forward: selective recomputation is the faster of the two that fit."""
    path = tmp_path / "tight.json"
    profile = synthetic_profile(blocks=6, micro_batch_sizes=[4], hidden=1024, seq_len=4096, device="cpu",
                                attention_core=attention_core)  # fmt: skip
    write_json_atomic(path, profile.model_copy(update={"device_memory_bytes": int(2.2 * 2**30)}))
    return path


def _plan(tmp_path, *flags, profile=None):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "--profile", str(profile or _tight_profile(tmp_path)), "--cluster", "local",
                                 "--devices", "1", "--global-batch", "8", "--no-morph", "-o", str(out), *flags])
    return result, out


@pytest.mark.parametrize(
    "flags, granularities",
    [
        ([], {"selective", "layer"}),  # auto: memory forces recomputation; selective is faster
        (["--recompute", "auto"], {"selective", "layer"}),
        (["--recompute", "always"], {"selective", "layer"}),
        (["--recompute", "selective"], {"selective"}),
        (["--recompute", "SELECTIVE"], {"selective"}),
    ],
)
def test_selective_recomputation_is_searched_and_chosen_where_memory_binds(tmp_path, flags, granularities):
    result, out = _plan(tmp_path, *flags)
    assert result.exit_code == 0, result.output
    written = load_model(Plan, out)
    assert {c.recompute_granularity.label for c in written.candidates} == granularities
    assert written.chosen.selective_recompute and not written.chosen.checkpoint_layers
    assert written.request.recompute.value == (flags[1].lower() if flags else "auto")
    # The table and the chosen line say which recomputation a candidate uses.
    assert "+sel" in result.output and "selective-recompute" in result.output


@pytest.mark.parametrize("flags", [["--recompute", "never"], ["--no-recompute"], ["--recompute", "stage"]])
def test_without_selective_or_per_layer_recomputation_nothing_fits(tmp_path, flags):
    result, _ = _plan(tmp_path, *flags)
    assert result.exit_code == 2, result.output
    assert "does not fit in device memory" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--recompute", "partial"], "unknown --recompute 'partial'"),
        (["--recompute", "selective", "--no-recompute"], "--no-recompute contradicts --recompute selective"),
        (["--recompute", "always", "--no-recompute"], "--no-recompute contradicts --recompute always"),
    ],
)
def test_a_bad_recompute_value_exits_2_naming_it(tmp_path, flags, message):
    result, _ = _plan(tmp_path, *flags)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    if "partial" in flags:
        assert "never, stage, layer, selective, always, auto" in result.output


def test_selective_alone_with_a_profile_without_an_attention_core_says_why(tmp_path):
    result, _ = _plan(tmp_path, "--recompute", "selective", profile=_tight_profile(tmp_path, attention_core=None))
    assert result.exit_code == 2
    assert "records no attention core" in result.output and "Traceback" not in result.output
    # auto and always go on without it.
    result, out = _plan(tmp_path, "--recompute", "always", profile=_tight_profile(tmp_path, attention_core=None))
    assert result.exit_code == 0, result.output
    assert load_model(Plan, out).chosen.checkpoint_layers
