"""docs/configuration.md is generated from the code (cluster/config_reference.py) and must
equal what the generator writes now: a changed option, manifest field or serve flag fails
here until the page is written again."""

from __future__ import annotations

import dataclasses
import re

from cluster.config_reference import COMMAND, PAGE, main, render
from cluster.local import POOLS, SERVE_FLAGS
from deploy.manifest import Manifest
from engine.options import EngineOptions
from kvtransfer.options import TransferOptions

# Pool engine overrides are one row each: they repeat spec.engine's fields.
LEAF_SECTIONS = {f"spec.{pool}.engine" for pool in POOLS}


def schema_paths() -> list[str]:
    """Every field path of the manifest, from its JSON schema (not the generator's walk)."""
    schema = Manifest.model_json_schema()
    defs = schema.get("$defs", {})

    def resolve(node: dict) -> dict:
        if "$ref" in node:
            return defs[node["$ref"].rsplit("/", 1)[1]]
        for option in node.get("anyOf", ()):
            if "$ref" in option:
                return defs[option["$ref"].rsplit("/", 1)[1]]
        return node

    paths = []

    def walk(node: dict, prefix: str) -> None:
        for name, sub in node["properties"].items():
            path = f"{prefix}.{name}" if prefix else name
            target = resolve(sub)
            if "properties" in target and path not in LEAF_SECTIONS:
                walk(target, path)
            else:
                paths.append(path)

    walk(schema, "")
    return paths


def row(page: str, name: str) -> str:
    """The table row whose first cell is `name`."""
    found = re.findall(rf"^\| `{re.escape(name)}` \|.*$", page, flags=re.M)
    assert found, f"no row for {name}"
    return found[0]


def test_the_page_is_what_the_generator_writes():
    assert PAGE.read_text() == render(), f"docs/configuration.md is out of date: run {COMMAND}"


def test_every_manifest_field_has_a_row_with_its_flag():
    page = render()
    flags = {}
    for name, (section, key) in SERVE_FLAGS.items():
        for part in POOLS if section == "pools" else (section,):
            flags[f"spec.{part}.{key}"] = "--" + name.replace("_", "-")
    paths = schema_paths()
    assert "spec.router.tls.client_ca_file" in paths and "spec.prefill.engine" in paths
    for path in paths:
        line = row(page, path)
        if path in flags:
            assert f"| `{flags[path]}` |" in line, path
    assert set(flags) <= set(paths)


def test_every_engine_and_transfer_option_has_its_default_and_description():
    engine = render().split("## Engine options", 1)[1].split("## Transfer options", 1)
    for text, options in ((engine[0], EngineOptions), (engine[1], TransferOptions)):
        for f in dataclasses.fields(options):
            line = row(text, f.name)
            assert f.metadata["description"] in line, f.name
            shown = line.split(" | ")[2].strip("`")
            expected = "null" if f.default is None else str(f.default)
            assert shown == (expected.lower() if isinstance(f.default, bool) else expected)


def test_check_finds_a_stale_page(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    page.write_text(render())
    assert main(["--check", str(page)]) == 0
    page.write_text(render().replace("tokens per KV block", "tokens per block", 1))
    assert main(["--check", str(page)]) == 1
    err = capsys.readouterr().err
    changed = [line for line in err.splitlines() if line[:1] in "+-" and "|" in line]
    stale = "| `spec.engine.block_size` | integer | `16` | >= 1, <= 256 | `--block-size` |"
    assert changed == [f"-{stale} tokens per block |", f"+{stale} tokens per KV block |"]
    assert COMMAND in err
