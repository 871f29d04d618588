"""``fsd calibrate`` through the real CLI entry point (tiny pair, quick settings)."""

from __future__ import annotations

import json

import pytest

from fsd_cli.main import main
from sim.profile import Profile


def test_cli_quick_on_the_tiny_pair_writes_a_profile(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    rc = main(["calibrate", "--pair", "tiny", "--quick", "--no-progress", "--out", str(out),
               "--batch-sizes", "1,2", "--thresholds", "kl=0,1"])
    assert rc == 0
    profile = Profile.load(out)
    assert list(profile.thresholds("kl", 4)) == [0.0, 1.0]
    assert "calibrate" in profile.provenance.command
    headline = json.loads(capsys.readouterr().out)
    assert [row["T"] for row in headline["per_threshold"]] == [0.0, 1.0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ks", "4,x"], "--ks"),
        (["--ks", "0"], "ks"),
        (["--divs", "nope"], "nope"),
        (["--thresholds", "kl=0,-2"], "thresholds"),
    ],
)
def test_cli_bad_flags_are_errors_naming_them(tmp_path, capsys, argv: list[str], message: str) -> None:
    rc = main(["calibrate", "--pair", "tiny", "--quick", "--no-progress", "--out", str(tmp_path / "p.json"), *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_an_output_directory_that_does_not_exist(tmp_path, capsys) -> None:
    rc = main(["calibrate", "--pair", "tiny", "--quick", "--out", str(tmp_path / "missing" / "p.json")])
    assert rc == 2
    assert "--out" in capsys.readouterr().err
