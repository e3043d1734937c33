"""Write the settings reference (docs/settings.md) from the settings classes' own docstrings.

    python docs/make_settings.py > docs/settings.md

Every table row is one flag: the field's name, its type, its default and the docstring written under the field,
read with ``hf_cgpu.settings.field_docs`` and ``cli_fields``, the same text ``--help`` prints. The presets are read
from their JSON files. ``tests/test_docs.py`` runs this script and fails when the committed docs/settings.md differs.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Any

from hf_cgpu.commands.budget import BudgetSettings
from hf_cgpu.evaluation.flow import ImageEvalSettings
from hf_cgpu.flow.sample_settings import SampleSettings
from hf_cgpu.generate import GenerateSettings
from hf_cgpu.gguf_export import ExportSettings
from hf_cgpu.optim import OPTIMIZERS
from hf_cgpu.recipes import RECIPES, LaunchSettings
from hf_cgpu.settings import TrainSettings, choices_text, cli_fields, field_docs, list_presets, load_preset

REGENERATE = "python docs/make_settings.py > docs/settings.md"

TYPES = {bool: "true\\|false", int: "int", float: "float", str: "text"}


def anchor(name: str) -> str:
    """GitHub's anchor of a ``## name`` heading made of letters and digits."""
    return "#" + name.lower()


def cell(text: str) -> str:
    """Text that stays inside one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def shown(value: Any) -> str:
    """A default as it is typed on the command line (``--help`` writes it the same way)."""
    if value is dataclasses.MISSING:
        return "(required)"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def kind(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Union or str(typing.get_origin(tp)) == "types.UnionType":
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return TYPES.get(tp, getattr(tp, "__name__", str(tp)))


def choices(field: dataclasses.Field) -> str:
    """`` Choices: ...`` where the field's registry lists them, as ``--help`` adds it."""
    return choices_text(field.metadata.get("choices"))


def settings_table(cls: type, note: str = "") -> str:
    """``## ClassName``, its docstring's first line, and one row per flag."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    title = (cls.__doc__ or "").strip().splitlines()[0]
    lines = [f"## {cls.__name__}", "", f"{title}{note}", "", "| flag | type | default | what it does |",
             "|---|---|---|---|"]
    for f in cli_fields(cls):
        lines.append(f"| `--{f.name}` | {kind(hints[f.name])} | {cell(shown(f.default))} | "
                     f"{cell(docs.get(f.name, '') + choices(f))} |")
    return "\n".join(lines)


def commands_table(optimizer_classes: list[type]) -> str:
    """Which settings each command reads, linked to their tables."""
    def link(cls: type) -> str:
        return f"[{cls.__name__}]({anchor(cls.__name__)})"

    own = ", ".join(f"{link(c)} (with `--optimizer {n}`)" for n, c in optimizer_classes)
    rows = ["| command | settings |", "|---|---|"]
    for recipe in RECIPES.values():
        command = "hf-cgpu flow2d" if recipe.name == "flow2d" else f"hf-cgpu train {recipe.name}"
        script = f", `recipes/{recipe.script}`" if recipe.script else ""
        rows.append(f"| `{command}`{script} | {link(recipe.settings)}, {link(TrainSettings)}, {own}; "
                    f"{link(LaunchSettings)} (`hf-cgpu` only) |")
    rows += [
        f"| `hf-cgpu budget` | {link(RECIPES['gpt'].settings)}, {link(TrainSettings)}, {own}, {link(BudgetSettings)} |",
        f"| `hf-cgpu generate MODEL PROMPT ...` | {link(GenerateSettings)} |",
        f"| `hf-cgpu sample RUN` | {link(SampleSettings)} |",
        f"| `hf-cgpu eval RUN --classifier DIR` (images) | {link(ImageEvalSettings)} |",
        f"| `hf-cgpu export DIR --gguf` | {link(ExportSettings)} |",
    ]
    return "\n".join(rows)


def presets_tables() -> str:
    """Each preset family: the preset, its one-line description and the settings it sets."""
    out = []
    for recipe in RECIPES.values():
        names = list_presets(recipe.presets) if recipe.presets else []
        if not names:
            continue
        default = f" (`{recipe.default_preset}` when none is named)" if recipe.default_preset else ""
        out += [f"### `{recipe.name}` presets{default}", "", "| preset | what it is for | settings it sets |",
                "|---|---|---|"]
        for name in names:
            preset = load_preset(name, recipe.presets)
            described = preset.pop("description", "")
            values = ", ".join(f"`{k}` {v if not isinstance(v, bool) else str(v).lower()}"
                               for k, v in preset.items())
            out.append(f"| `{name}` | {cell(described)} | {cell(values)} |")
        out.append("")
    return "\n".join(out).rstrip()


def render() -> str:
    optimizers = [(name, spec.settings) for name, spec in OPTIMIZERS.items() if spec.settings is not None]
    task_classes = list(dict.fromkeys(r.settings for r in RECIPES.values()))
    parts = [
        "# Settings reference",
        "",
        (f"Generated from the settings' docstrings by `{REGENERATE}`: the same text as each command's `--help`. "
         "Edit the docstrings in the code, not this file; `tests/test_docs.py` fails when the two differ."),
        "",
        ("Every setting is a flag, `--name VALUE`; a true/false flag given alone means true (`--compile` = "
         "`--compile true`). A value comes from the command line, else from the preset (`--preset NAME`, or a "
         "`.json` file of settings), else from the default below. `COMMAND --help` prints the value a run would "
         "use, the preset's where it sets one."),
        "",
        "## Which command reads which settings",
        "",
        commands_table(optimizers),
        "",
        ("`hf-cgpu eval RUN --dataset DATA` (text), `hf-cgpu push`, `hf-cgpu verify` and `hf-cgpu bench` take a few "
         "plain options: their `--help` lists them."),
        "",
        "## Presets",
        "",
        ("A preset is a JSON file of settings under `hf_cgpu/presets/<family>/` with a one-line `description`; "
         "what each one has measured is in [presets.md](presets.md)."),
        "",
        presets_tables(),
        "",
        settings_table(TrainSettings),
        "",
        *[x for cls in task_classes for x in (settings_table(cls), "")],
        *[x for name, cls in optimizers for x in (settings_table(cls, f" Only with `--optimizer {name}`."), "")],
        settings_table(LaunchSettings, " `hf-cgpu train NAME` and `hf-cgpu flow2d` only; with `accelerate launch` "
                                       "the launcher's own flags do this."),
        "",
        settings_table(BudgetSettings),
        "",
        settings_table(GenerateSettings),
        "",
        settings_table(SampleSettings),
        "",
        settings_table(ImageEvalSettings),
        "",
        settings_table(ExportSettings),
        "",
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(render())
