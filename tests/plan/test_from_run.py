"""Re-planning from a run: measured timings replace the profiled ones of the mode each layer ran in, the rest of the
step is the run's, and `hetero plan --from-run` writes a plan `hetero run` accepts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetero.cli.main import main
from hetero.errors import USAGE, HeteroError
from hetero.launch.preflight import check_plan
from hetero.plan.from_run import _layer, measured_profile
from hetero.plan.model import costs
from hetero.schema import files
from hetero.schema.plan import LayerPlan, Plan
from tests.cli.test_report import write_run
from tests.report.test_compare import shipped, synthetic_run


def test_layers_take_the_measured_times_and_the_tail_is_the_runs():
    plan, profile = shipped()
    run = synthetic_run(plan, profile, scale=2.0)
    new = measured_profile(profile, plan, run)
    for old, x in zip(profile.layers, new.layers):
        assert (x.fp_s, x.bp_s, x.fp_end_s) == pytest.approx((2 * old.fp_s, 2 * old.bp_s, 2 * old.fp_end_s))
        assert x.saved_bytes == old.saved_bytes  # the run did not measure them (tiering ran)
    assert costs(new).tail_s == pytest.approx(run.timing.other_s)
    assert new.training.forward_s == run.timing.forward_s


def test_a_layer_time_replaces_the_time_of_the_mode_it_ran_in():
    _, profile = shipped()
    x = replace(profile.layers[3], fp_dha_s=1.0, bp_dha_s=1.0, bp_grad_host_s=1.0)
    m = synthetic_run(*shipped(), scale=3.0).layers[3]
    dha = _layer(x, m, LayerPlan(name=x.name, mode="dha", grad="gpu"))
    assert (dha.fp_s, dha.fp_dha_s, dha.bp_s, dha.bp_dha_s) == (x.fp_s, m.fp_s, x.bp_s, m.bp_s)
    host = _layer(x, m, LayerPlan(name=x.name, mode="gfgb", grad="host"))
    assert (host.fp_s, host.bp_s, host.bp_grad_host_s) == (m.fp_s, x.bp_s, m.bp_s)


def test_another_models_run_is_refused():
    plan, profile = shipped()
    run = synthetic_run(plan, profile)
    run = replace(run, source=replace(run.source, model_fingerprint="sha256:" + "1" * 64))
    with pytest.raises(HeteroError) as e:
        measured_profile(profile, plan, run)
    assert e.value.exit_code == USAGE and e.value.hint is not None


def test_plan_from_run_writes_a_plan_hetero_run_accepts(tmp_path, capfd):
    run = write_run(tmp_path)
    out = tmp_path / "replanned.yaml"
    assert main(["plan", "--from-run", str(run), "-o", str(out)]) == 0
    assert f"wrote {tmp_path / 'replanned.profile.yaml'}" in capfd.readouterr().out
    plan = files.load(out, expect=Plan)
    assert plan.source.profile == str(tmp_path / "replanned.profile.yaml")
    assert check_plan(out).warnings == []
