import json

import numpy as np
import pytest

from sim.profile import Profile

from .conftest import handmade_profile


def test_default_profile_is_calibrated_on_the_default_pair() -> None:
    p = Profile.default()
    assert p.provenance.source == "calibrated"
    assert p.provenance.pair.startswith("smollm2-135m")
    assert p.default_k == 4 and p.mean_distortion(p.default_div, 0.0, 4) == 0.0
    # Measured: SD (T = 0) emits between 1 and k + 1 tokens per iteration, more as T grows.
    sd, loose = p.expected_tokens_per_iter("kl", 0.0, 4), p.expected_tokens_per_iter("kl", 4.0, 4)
    assert 1.0 < sd < loose <= 5.0
    assert float(p.latency.iteration_ms(8, 4)) > float(p.latency.iteration_ms(1, 4)) > 0


def test_handmade_profile_matches_the_measured_anchor_points() -> None:
    p = handmade_profile()
    assert p.schema_version == 1
    assert p.provenance.source == "hand-made from MEASURED.md"
    # MEASURED.md, k = 4: SD 3.0 tokens/iteration, FSD kl <= 1.0 4.3, accept-all 4.8.
    assert p.expected_tokens_per_iter("kl", 0.0, 4) == pytest.approx(3.0, abs=0.01)
    assert p.expected_tokens_per_iter("kl", 1.0, 4) == pytest.approx(4.3, abs=0.01)
    assert p.expected_tokens_per_iter("kl", 8.0, 4) == pytest.approx(4.8, abs=0.01)
    # Batch 1, k = 4: 4 int8 draft forwards (11 ms) + one 5-token fp32 verify (63 ms).
    assert float(p.latency.iteration_ms(1, 4)) == pytest.approx(4 * 11 + 63)
    assert p.latency.prefill_ms(200) == pytest.approx(325 + 97, rel=0.01)
    assert p.mean_distortion("kl", 0.0, 4) == 0.0


def test_interpolation_is_monotone_in_threshold_and_flat_beyond_the_grid() -> None:
    p = handmade_profile()
    ts = np.linspace(0, 12, 121)
    tokens = [p.expected_tokens_per_iter("kl", float(t), 4) for t in ts]
    dist = [p.mean_distortion("kl", float(t), 4) for t in ts]
    assert np.all(np.diff(tokens) >= -1e-12)
    assert np.all(np.diff(dist) >= -1e-12)
    assert p.expected_tokens_per_iter("kl", 12.0, 4) == p.expected_tokens_per_iter("kl", 8.0, 4)
    # Halfway between grid points 0.5 and 0.75 is the mean of the two.
    mid = p.position_accept("kl", 0.625, 4)
    assert np.allclose(mid, (p.position_accept("kl", 0.5, 4) + p.position_accept("kl", 0.75, 4)) / 2)


def test_unknown_div_or_k_is_a_value_error_naming_it() -> None:
    p = handmade_profile()
    with pytest.raises(ValueError, match="div 'tv'"):
        p.survival("tv", 0.5, 4)
    with pytest.raises(ValueError, match="k=5"):
        p.survival("kl", 0.5, 5)
    with pytest.raises(ValueError, match="threshold"):
        p.survival("kl", -1.0, 4)


def _default_dict() -> dict:
    return json.loads(handmade_profile().model_dump_json())


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d["acceptance"][0].update(position_accept=[0.5, 1.5]), "position_accept"),
        (lambda d: d["acceptance"][0].update(position_accept=[0.5]), "position_accept"),
        (lambda d: d["latency"].update(verify_a_ms=-1), "verify_a_ms"),
        (lambda d: d["provenance"].update(source="guessed"), "source"),
        (lambda d: d.update(default_div="js"), "default_div"),
    ],
)
def test_bad_profile_file_names_the_field(tmp_path, mutate, field) -> None:
    data = _default_dict()
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field):
        Profile.load(path)


def test_non_monotone_grid_is_rejected(tmp_path) -> None:
    data = _default_dict()
    k4 = [e for e in data["acceptance"] if e["k"] == 4]
    k4[-1]["position_accept"] = [0.1] * 4
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="non-decreasing"):
        Profile.load(path)


def test_save_load_round_trip(tmp_path) -> None:
    p = handmade_profile()
    p.save(tmp_path / "copy.json")
    assert Profile.load(tmp_path / "copy.json").model_dump() == p.model_dump()


def test_speed_curve_and_latency_model_agree_with_the_profile() -> None:
    p = handmade_profile()
    curve = p.to_speed_curve("kl", 4)
    assert [pt.threshold for pt in curve.points] == list(p.thresholds("kl", 4))
    assert curve.tokens_per_iteration(1.0) == pytest.approx(p.expected_tokens_per_iter("kl", 1.0, 4))
    lat = p.to_latency_model(4)
    for b in (1, 3, 8):
        assert lat.iteration_ms(b) == pytest.approx(float(p.latency.iteration_ms(b, 4)))


def test_measured_prefills_are_checked_and_read_piecewise() -> None:
    base = _default_dict()
    lat = {**base["latency"], "prefill_fixed_ms": 50.0, "prefill_ms_per_token": 2.0,
           "prefill_ms_by_tokens": [[16, 120.0], [64, 160.0]]}
    m = Profile.model_validate({**base, "latency": lat}).latency
    assert [m.prefill_ms(n) for n in (1, 16, 40, 64, 100)] == pytest.approx([120.0, 120.0, 140.0, 160.0, 232.0])
    for bad in ([], [[16, 120.0], [16, 130.0]], [[64, 160.0], [16, 120.0]], [[16, 0.0]], [[16, float("nan")]]):
        with pytest.raises(ValueError, match="prefill_ms_by_tokens"):
            Profile.model_validate({**base, "latency": {**lat, "prefill_ms_by_tokens": bad}})


def test_machine_variation_is_checked_and_read_by_kind_and_rows() -> None:
    """The step shapes are read per kind of step at 1..max_batch rows (the last beyond the list); bad values are
    refused naming the field; a profile without any variation is the model's own time."""
    base = _default_dict()
    assert not Profile.model_validate(base).latency.varies_steps
    lat = {**base["latency"], "plain_step_scale_by_batch": [1.1, 1.3], "speculative_step_scale_by_batch": [0.9]}
    m = Profile.model_validate({**base, "latency": lat}).latency
    assert m.varies_steps
    table = m.step_scale_table(4)
    assert table.tolist() == [[1.0, 1.1, 1.3, 1.3, 1.3], [1.0, 0.9, 0.9, 0.9, 0.9]]
    assert Profile.model_validate({**base, "latency": {**base["latency"], "step_jitter_sigma": 0.2}}).latency.varies_steps
    for field, bad in (("plain_step_scale_by_batch", []), ("speculative_step_scale_by_batch", [1.0, 0.0]),
                       ("plain_step_scale_by_batch", [float("inf")])):
        with pytest.raises(ValueError, match="step scale by batch"):
            Profile.model_validate({**base, "latency": {**base["latency"], field: bad}})
    for field, bad in (("step_drift_sigma", -0.1), ("step_drift_tau_s", 0.0), ("step_offset_sigma", 3.0)):
        with pytest.raises(ValueError, match=field):
            Profile.model_validate({**base, "latency": {**base["latency"], field: bad}})
