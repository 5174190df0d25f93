"""``tiertrain config``: the resolved training config as YAML, each field with its documentation."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import yaml

from ..config import field_docs
from ..tiers import Tier
from .common import OVERRIDES_HELP, load_with_deepspeed, split_args


def cmd_config(argv: list[str]) -> int:
    own, overrides = split_args(argv, {"--config": True, "--from-deepspeed": True})
    p = argparse.ArgumentParser(
        prog="tiertrain config", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="tiertrain config [-h] [--config FILE] [--from-deepspeed ds.json] [--section.key VALUE ...]",
        description="Print the resolved training config (defaults < --config file < DeepSpeed config <\n"
                    "overrides) as YAML, each field with its documentation; the output is a valid --config file.",
        epilog=OVERRIDES_HELP)
    p.add_argument("--config", metavar="FILE", help="YAML or TOML file with config sections")
    p.add_argument("--from-deepspeed", metavar="FILE", help="a DeepSpeed JSON config (docs/deepspeed.md)")
    args = p.parse_args(own)
    cfg, fates = load_with_deepspeed(args.config, overrides, args.from_deepspeed)
    if fates:
        print(f"# from the DeepSpeed config {args.from_deepspeed}, key by key:")
        print("\n".join(f"#   {line}" for line in fates))
    print("# tiertrain training config (resolved); use with: tiertrain train --config FILE")
    print("\n".join(render_config(cfg)))
    return 0


def _all_docs(cls: type) -> dict[str, str]:
    """Field docs of a dataclass including those of its dataclass bases."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    return docs


def _scalar(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, Tier):
        value = value.config_name
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    return text


_TOP_ORDER = ("steps", "seed", "model", "data")


def render_config(obj: Any, indent: int = 0) -> list[str]:
    """A dataclass as YAML lines, each field preceded by its docstring as a comment."""
    docs = _all_docs(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    if indent == 0:
        names = [n for n in _TOP_ORDER if n in names] + [n for n in names if n not in _TOP_ORDER]
    pad = "  " * indent
    lines: list[str] = []
    for name in names:
        value = getattr(obj, name)
        doc = docs.get(name, "")
        if dataclasses.is_dataclass(value) and indent == 0 and lines:
            lines.append("")
        for line in doc.splitlines():
            lines.append(f"{pad}# {line.strip()}".rstrip())
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{name}:")
            lines.extend(render_config(value, indent + 1))
        else:
            lines.append(f"{pad}{name}: {_scalar(value)}")
    return lines
