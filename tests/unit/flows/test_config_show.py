"""`trajflow config show`: the effective config as YAML that loads back, each field's description above it."""

from __future__ import annotations

import yaml

from flows.cli import build_parser, main
from tasks.run_config import RunConfig, load_config


def test_config_show_prints_the_effective_config_with_every_description(tmp_path, capsys):
    args = ["configs/default.yaml", "--set", "steps=3", "--set", "judge={}", "--set", "trainer.target_modules=[q_proj]"]
    assert main(["config", "show", *args]) == 0
    out = capsys.readouterr().out
    config = load_config(args[0], args[2::2])
    assert yaml.safe_load(out) == config.model_dump(mode="json")
    shown = tmp_path / "shown.yaml"
    shown.write_text(out)
    assert load_config(shown) == config  # a config file in its own right

    lines = out.splitlines()
    assert lines[:2] == ["# agent name from `agents/registry.py`, or `module:attr` for your own", "agent: arithmetic"]
    assert "steps: 3" in lines and "trainer:" in lines and "  learning_rate: 0.0002" in lines
    for section, model in [(None, RunConfig), ("trainer", type(config.trainer)), ("judge", type(config.judge))]:
        start, pad = (0, "") if section is None else (lines.index(f"{section}:") + 1, "  ")
        for name, field in model.model_fields.items():
            key = next(i for i in range(start, len(lines)) if lines[i].startswith(f"{pad}{name}:"))
            above = key
            while lines[above - 1].startswith(f"{pad}# "):
                above -= 1
            comment = " ".join(line.strip()[2:] for line in lines[above:key])
            assert comment == " ".join(field.description.split()), name  # the description, wrapped above it


def test_train_help_points_to_config_show(capsys):
    parser = build_parser()
    for command in ("train", "eval"):
        try:
            parser.parse_args([command, "--help"])
        except SystemExit:
            pass
        assert "`trajflow config show [CONFIG] [--set ...]` prints the effective config" in " ".join(
            capsys.readouterr().out.split())
