"""The configuration reference, docs/configuration.md, generated from the code.

Every manifest field comes from deploy/manifest.py's pydantic models (whose spec.model,
spec.engine and spec.transfer fields derive from engine/options.py and kvtransfer/options.py),
every engine and transfer option from its dataclass, and the `baton serve` flag of a field from
cluster/local.py's SERVE_FLAGS. tests/deploy/test_config_reference.py fails when the page and
the code disagree.

    python -m cluster.config_reference > docs/configuration.md          # write the page
    python -m cluster.config_reference --check docs/configuration.md    # exit 1 if it differs

It lives in `cluster` because the serve flags do: `deploy` may not import `cluster`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from cluster.local import LOCAL_MANIFEST, POOLS, SERVE_FLAGS
from deploy.manifest import ENGINE_OPTIONS_ELSEWHERE, MODEL_FIELDS, Manifest
from engine.options import EngineOptions
from kvtransfer.options import TransferOptions

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
COMMAND = "python -m cluster.config_reference > docs/configuration.md"
RULE_NAMES = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


@dataclass(frozen=True, slots=True)
class Row:
    """One setting as the page shows it."""

    path: str  # e.g. spec.engine.chunk_size, or an option name
    type: str
    default: str
    rules: str
    flag: str  # the `baton serve` flag, or ""
    manifest: str  # an option's manifest field (or where it is set instead); "" for fields
    description: str


# ---- rendering values --------------------------------------------------------------------------
def type_name(annotation: Any) -> str:
    """A field's type in words: integer, one of `a`, `b`, mapping of string to number, ..."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in get_args(annotation))
    if origin in (Union, UnionType):
        parts = [type_name(a) for a in get_args(annotation) if a is not type(None)]
        nullable = type(None) in get_args(annotation)
        return " or ".join(parts) + (" or null" if nullable else "")
    if origin is dict:
        key, value = get_args(annotation)
        return f"mapping of {type_name(key)} to {type_name(value)}"
    if origin is list:
        return f"list of {type_name(get_args(annotation)[0])}s"
    names = {int: "integer", float: "number", str: "string", bool: "boolean"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def value_text(value: Any) -> str:
    """A default as YAML would write it, in a code span."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}`"
    if isinstance(value, list):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    return f"`{value}`"


def rules_text(rules: dict[str, Any]) -> str:
    """Bounds and patterns: `>= 1`, `<= 256`, length 1-63, pattern `...`."""
    out = [f"{op} {rules[key]}" for key, op in RULE_NAMES if key in rules]
    if "min_length" in rules or "max_length" in rules:
        low, high = rules.get("min_length"), rules.get("max_length")
        out.append(f"length {low}-{high}" if high else f"length >= {low}")
    if "pattern" in rules:
        out.append(f"pattern `{rules['pattern']}`")
    return ", ".join(out)


def pydantic_rules(info) -> dict[str, Any]:
    """The bounds of a pydantic field from its metadata (annotated_types and pydantic's)."""
    found = {}
    for constraint in info.metadata:
        for name in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern"):
            value = getattr(constraint, name, None)
            if value is not None:
                found[name] = value
    return found


def cell(text: str) -> str:
    """Text safe inside a table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


# ---- collecting rows ---------------------------------------------------------------------------
def serve_flags() -> dict[str, str]:
    """Manifest field path -> the `baton serve` flag that sets it."""
    out = {}
    for name, (section, key) in SERVE_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        for part in POOLS if section == "pools" else (section,):
            out[f"spec.{part}.{key}"] = flag
    return out


def default_of(info) -> Any:
    if info.default_factory is not None:
        return info.default_factory()
    return info.default


def _sub_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a section field (a model, or an optional model other than a per-pool
    engine override, which is a row: it repeats spec.engine's fields)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for a in get_args(annotation):
        if isinstance(a, type) and issubclass(a, BaseModel) and a.__name__ != "EngineSpec":
            return a
    return None


def model_rows(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, Row]]:
    """(section, row) for every field of `model`, then, recursively, of its sub-models; a
    sub-model field heads its own section and is not a row itself."""
    flags = serve_flags()
    nested = []
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        annotation = info.annotation
        sub = _sub_model(annotation)
        if sub is not None:
            nested.append((sub, path))
            continue
        if any(isinstance(a, type) and issubclass(a, BaseModel) for a in get_args(annotation)):
            kind = "mapping of `spec.engine` fields, or null"
        else:
            kind = type_name(annotation)
        row = Row(
            path=path,
            type=kind,
            default="required" if info.is_required() else value_text(default_of(info)),
            rules=rules_text(pydantic_rules(info)),
            flag=flags.get(path, ""),
            manifest="",
            description=info.description or "",
        )
        yield prefix, row
    for sub, path in nested:
        yield from model_rows(sub, path)


def manifest_sections() -> dict[str, list[Row]]:
    """Section (the parent path, "" for the top level) -> its rows, in schema order."""
    sections: dict[str, list[Row]] = {}
    for section, row in model_rows(Manifest, ""):
        sections.setdefault(section, []).append(row)
    return sections


def engine_option_rows() -> list[Row]:
    """Every EngineOptions field, with the manifest field that sets it (or where instead)."""
    where = {option: f"spec.model.{key}" for key, option in MODEL_FIELDS.items()}
    flags = serve_flags()
    rows = []
    for f in dataclasses.fields(EngineOptions):
        path = where.get(f.name) or (
            "" if f.name in ENGINE_OPTIONS_ELSEWHERE else f"spec.engine.{f.name}"
        )
        elsewhere = ENGINE_OPTIONS_ELSEWHERE.get(f.name, "")
        if elsewhere.startswith("spec.<pool>."):  # a pool field: both pools' flag is one
            flag = flags.get("spec.prefill." + elsewhere.split(".")[2].split()[0], "")
        else:
            flag = flags.get(path, "")
        rows.append(option_row(f, f"`{path}`" if path else elsewhere, flag))
    return rows


def transfer_option_rows() -> list[Row]:
    """Every TransferOptions field; each is spec.transfer.<name> in the manifest."""
    return [
        option_row(f, f"`spec.transfer.{f.name}`", "") for f in dataclasses.fields(TransferOptions)
    ]


def option_row(f: dataclasses.Field, manifest: str, flag: str) -> Row:
    """The row of one options-dataclass field (engine/options.py's option() metadata)."""
    kind = Literal[f.metadata["choices"]] if "choices" in f.metadata else f.type
    rules = {k: v for k, v in f.metadata.items() if k in ("ge", "gt", "le", "min_length")}
    return Row(
        path=f.name,
        type=type_name(kind),
        default=value_text(f.default),
        rules=rules_text(rules),
        flag=flag,
        manifest=manifest,
        description=f.metadata["description"],
    )


# ---- the page ----------------------------------------------------------------------------------
SECTION_NOTES = {
    "": "The document itself.",
    "metadata": "The cluster's name.",
    "spec": "The desired cluster; every section below has defaults, so `spec: {}` is valid.",
    "spec.model": "What every worker serves (engine options `model`, `dtype`, "
    "`skip_tokenizer_init`).",
    "spec.engine": "Engine options of both pools. `spec.prefill.engine` and "
    "`spec.decode.engine` take the same fields and replace this section for one pool; "
    "`block_size` and `hash_seed` must be equal in both pools (the router hashes prompts "
    "with them).",
    "spec.prefill": "The prefill pool. `replicas: 0` makes the cluster aggregated: every "
    "request is prefilled on its decode worker and no KV moves.",
    "spec.decode": "The decode pool (at least one worker).",
    "spec.router": "The front doors (gRPC and OpenAI-compatible HTTP), routing, admission "
    "and API keys.",
    "spec.router.tls": "TLS for both front doors; unset: plain TCP. Paths are on the head node.",
    "spec.transfer": "How KV moves between a prefill and a decode worker (TransferOptions).",
}
CROSS_FIELD = (
    "- `chunk_size` must not exceed `max_num_batched_tokens` (per pool).",
    "- `block_size` and `hash_seed` must be the same for the prefill and the decode pool.",
    "- `int8_activations` needs CPU float32 with GGUF blocks (`use_gguf_blocks`, a model "
    "converted from a GGUF); elsewhere the engine refuses to start and says why.",
    "- Unknown fields are errors, and types are strict: `replicas: true` or "
    '`block_size: "16"` are refused.',
    "- `baton deploy apply` and `baton serve` also check, before anything starts, that the Ray "
    "cluster can hold every worker's `resources` (in total, and one bundle on one node).",
)


def table(rows: list[Row], first: str, *, flags: bool, manifest: bool = False) -> list[str]:
    """A markdown table of rows; optional columns: the manifest field, the serve flag."""
    columns = [first, "type", "default", "rules"]
    columns += ["manifest"] if manifest else []
    columns += ["`baton serve`"] if flags else []
    lines = ["| " + " | ".join(columns) + " | description |", "|---" * (len(columns) + 1) + "|"]
    for r in rows:
        values = [f"`{r.path}`", r.type, r.default, r.rules]
        values += [r.manifest] if manifest else []
        values += [f"`{r.flag}`" if r.flag else ""] if flags else []
        lines.append("| " + " | ".join(cell(v) for v in [*values, r.description]) + " |")
    return lines


def render() -> str:
    """The whole page, as docs/configuration.md holds it."""
    sections = manifest_sections()
    local = LOCAL_MANIFEST.read_text().rstrip("\n")
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}`; do not edit by hand.",
        "     tests/deploy/test_config_reference.py fails when this page and the code "
        "disagree. -->",
        "",
        "A Baton cluster is described by a manifest: YAML with `apiVersion: baton/v1` and "
        "`kind: Cluster`, read by `baton deploy apply -f FILE` and `baton serve -f FILE`. "
        "Without `-f`, `baton serve` uses the manifest below with its flags applied on top "
        "(the `baton serve` column). A bad manifest is refused with one line per problem, "
        "naming the field path, the value and the rule, e.g. "
        "`spec.decode.replicas: 0 is invalid: Input should be greater than or equal to 1`.",
        "",
        "The default manifest of `baton serve` "
        "([deploy/examples/local.yaml](../deploy/examples/local.yaml)):",
        "",
        "```yaml",
        local,
        "```",
        "",
        "Contents: [manifest fields](#manifest-fields) · [checks across fields]"
        "(#checks-across-fields) · [engine options](#engine-options) · "
        "[transfer options](#transfer-options) · [`baton serve` flags](#baton-serve-flags)",
        "",
        "## Manifest fields",
        "",
    ]
    for section, rows in sections.items():
        out += [f"### {section or 'Top level'}", "", SECTION_NOTES.get(section, ""), ""]
        out += table(rows, "field", flags=True) + [""]
    out += ["## Checks across fields", "", *CROSS_FIELD, ""]
    out += [
        "## Engine options",
        "",
        "One engine's options (`engine/options.py`): keyword arguments of the offline "
        "`LLM(...)` and `LLMEngine(...)`; for a cluster's workers the manifest field of the "
        "`manifest` column sets them.",
        "",
        *table(engine_option_rows(), "option", flags=True, manifest=True),
        "",
        "## Transfer options",
        "",
        "How a worker moves KV (`kvtransfer/options.py`), set for a cluster by `spec.transfer`.",
        "",
        *table(transfer_option_rows(), "option", flags=False, manifest=True),
        "",
        "## `baton serve` flags",
        "",
        "Each flag sets one manifest field of the default manifest above (unset flags keep "
        "its value). `--kv-cache-memory-gb` also clears its `num_kv_blocks`, and "
        "`max_num_batched_tokens` is raised to `--chunk-size` where that is larger.",
        "",
        "| flag | sets |",
        "|---|---|",
        "| `-f FILE`, `--file FILE` | the whole manifest: FILE instead of the default one; "
        "the flags below then do not apply |",
    ]
    for name, (section, key) in SERVE_FLAGS.items():
        parts = POOLS if section == "pools" else (section,)
        where = ", ".join(f"`spec.{p}.{key}`" for p in parts)
        out.append(f"| `--{name.replace('_', '-')}` | {where} |")
    out += [
        "| `--api-key KEY` | clients must send KEY; it reaches the router in the "
        "`BATON_API_KEY` environment variable and `spec.router.api_key_env` names that "
        "variable (the key itself is never written to a manifest) |",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--check", metavar="PAGE", help="compare with this file instead of printing"
    )
    args = parser.parse_args(argv)
    page = render()
    if args.check is None:
        sys.stdout.write(page)
        return 0
    current = Path(args.check).read_text() if Path(args.check).is_file() else ""
    if current == page:
        return 0
    diff = difflib.unified_diff(
        current.splitlines(), page.splitlines(), args.check, "generated", lineterm=""
    )
    print("\n".join(diff), file=sys.stderr)
    print(f"{args.check} is out of date; regenerate it: {COMMAND}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
