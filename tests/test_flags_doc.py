"""docs/flags.md is what ``mambaradix.flags_doc`` generates from the config dataclasses: a
field added, renamed or re-documented without regenerating the file fails here, with the
command that regenerates it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mambaradix import flags_doc
from mambaradix.config import EngineConfig, opt

FLAGS_MD = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
STALE = (
    f"docs/flags.md is out of date with the config dataclasses; regenerate it from the "
    f"repository root with: {flags_doc.REGENERATE} (then review and commit the diff)"
)


def test_flags_md_is_current() -> None:
    assert FLAGS_MD.is_file(), STALE
    assert FLAGS_MD.read_text() == flags_doc.render(), STALE


def test_every_registered_flag_is_documented() -> None:
    """Every option of every subcommand's parser appears in the reference."""
    from mambaradix.cli import build_parser

    text = flags_doc.render()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        assert f"`mambaradix {name}`" in text
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in text, (name, option)


def test_an_extra_field_changes_the_render() -> None:
    """Negative control: one more config field, and the reference differs (so the file
    comparison above would fail until it is regenerated)."""
    extra = dataclasses.make_dataclass(
        "EngineConfig",
        [("brand_new_knob", int, opt(7, "A field nobody documented yet."))],
        bases=(EngineConfig,),
    )
    real = flags_doc.commands()
    changed = [(cmd, [extra if c is EngineConfig else c for c in cls]) for cmd, cls in real]
    text = flags_doc.render(changed)
    assert text != flags_doc.render(real)
    assert "| `--brand-new-knob` | int | `7` |  | A field nobody documented yet. |" in text


def test_check_mode_names_the_command(tmp_path, capsys) -> None:
    stale = tmp_path / "flags.md"
    stale.write_text(flags_doc.render().replace("--page-size", "--page-sise"))
    assert flags_doc.main(["--check", str(stale)]) == 1
    assert flags_doc.REGENERATE in capsys.readouterr().err
    stale.write_text(flags_doc.render())
    assert flags_doc.main(["--check", str(stale)]) == 0
    assert flags_doc.main(["--check", str(tmp_path / "missing.md")]) == 1
