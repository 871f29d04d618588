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


def test_cli_calibrates_acceptance_on_the_prompts_of_a_file(tmp_path) -> None:
    from decoder.calibration import CalibrationRecord

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\n\n  Count to five.  \nName a colour.\n", encoding="utf-8")
    out = tmp_path / "p.json"
    rc = main(["calibrate", "--pair", "tiny", "--quick", "--no-progress", "--out", str(out), "--batch-sizes", "1",
               "--thresholds", "kl=0,1", "--prompts-file", str(prompts), "--samples-per-prompt", "2"])
    assert rc == 0
    record = CalibrationRecord.model_validate(Profile.load(out).calibration)
    # Every prompt of the file (blank lines skipped, ends stripped), twice (two seeds) at every grid point.
    assert record.settings.prompt_texts == ("Say hello.", "Count to five.", "Name a colour.")
    assert record.settings.prompts == 3 and record.settings.samples_per_prompt == 2
    assert {len(s.request_drafted) for s in record.acceptance} == {6}
    # The two samples of a prompt are two draws, not one repeated: at T = 0 some prompt's pair differs.
    t0 = next(s for s in record.acceptance if s.threshold == 0.0)
    pairs = list(zip(t0.request_accepted[:3], t0.request_accepted[3:], strict=True))
    assert any(a != b for a, b in pairs)


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("\n \n", [], "holds no prompt"),
        ("one\ntwo\n", ["--prompts", "3"], "prompts 3 exceeds the prompt set's 2"),
        (None, [], "cannot read"),
    ],
)
def test_cli_bad_prompt_files_are_errors_naming_the_flag(tmp_path, capsys, content: str | None, extra: list[str],
                                                         message: str) -> None:
    prompts = tmp_path / "prompts.txt"
    if content is not None:
        prompts.write_text(content, encoding="utf-8")
    rc = main(["calibrate", "--pair", "tiny", "--quick", "--no-progress", "--out", str(tmp_path / "p.json"),
               "--prompts-file", str(prompts), *extra])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_serving_prompt_set_is_what_the_load_benchmark_sends() -> None:
    import argparse

    from fsd_cli.calibrate import register, settings_from_args
    from sim.prompts import PROMPTS

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["calibrate", "--out", "x.json", "--prompt-set", "serving"])
    settings = settings_from_args(args)
    assert settings.prompt_set == PROMPTS and settings.prompts == len(PROMPTS)
    with pytest.raises(SystemExit):  # one source of prompts at a time
        parser.parse_args(["calibrate", "--out", "x.json", "--prompt-set", "serving", "--prompts-file", "p.txt"])
