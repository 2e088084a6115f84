"""A wrong model.path fails with one line before torchrun and writes nothing; only `demo`
makes its tiny model, explicitly."""

import os

from skyrl_mega import cli

RECIPE = cli.DEFAULT_RECIPE


def _err_lines(capsys):
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_validate_with_a_typo_in_model_path_writes_nothing(tmp_path, capsys):
    typo = tmp_path / "tiny_qwen3_moee"
    rc = cli.main(["validate", "--recipe", RECIPE, f"model.path={typo}", f"data.train_path={tmp_path / 'd.jsonl'}"])
    lines = _err_lines(capsys)
    assert rc == 2
    assert len(lines) == 1 and f"no checkpoint at {typo}" in lines[0], lines
    assert not typo.exists() and os.listdir(tmp_path) == []


def test_train_with_a_typo_in_model_path_fails_before_torchrun(tmp_path, capsys):
    typo = tmp_path / "typo"
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, why in ((typo, "does not exist"), (empty, "no config.json")):
        rc = cli.main(["train", "--recipe", RECIPE, f"model.path={path}", f"output_dir={tmp_path / 'run'}",
                       f"data.train_path={tmp_path / 'd.jsonl'}", "--entry", "no_such_module_would_fail_if_launched"])
        lines = _err_lines(capsys)
        assert rc == 2 and len(lines) == 1 and f"no checkpoint at {path}" in lines[0] and why in lines[0], lines
    assert not typo.exists() and os.listdir(empty) == [] and not (tmp_path / "run").exists()


def test_demo_makes_its_tiny_model_then_launches(tmp_path, capsys):
    model = tmp_path / "tiny"
    entry = tmp_path / "entry_ok.py"  # stands in for the trainer: the ranks start and exit 0
    entry.write_text("import sys\nprint('ranks got', sys.argv[1:], flush=True)\n")
    args = ["demo", f"model.path={model}", f"output_dir={tmp_path / 'run'}", f"data.train_path={tmp_path / 'd.jsonl'}",
            "--entry", str(entry)]
    assert cli.main(["demo", "--cfg", "job", f"model.path={model}"]) == 0  # printing makes nothing
    assert not model.exists()
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert f"making tiny qwen3_moe model at {model}" in out
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    mtime = os.path.getmtime(model / "model.safetensors")
    assert cli.main(args) == 0  # there now: kept, not remade
    assert "making tiny" not in capsys.readouterr().out and os.path.getmtime(model / "model.safetensors") == mtime
