"""Docs stay navigable: every ``docs/*.md`` is reachable from README.md, and every repository path the
docs name (``docs/x.md``, ``configs/...``, ``scripts/...``, ``benchmarks/...``, ``tests/...``,
``hethub_jax/...`` ending in .md/.py/.yaml/.json, and relative Markdown links) exists. Build outputs
that a fresh clone lacks until built are listed in ``BUILT``."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILT = {"hethub_jax/comm/_hotpath.json"}  # written by python -m hethub_jax.comm.build_hotpath
PATH_RE = re.compile(r"(?<![\w/.])((?:docs|configs|scripts|benchmarks|tests|hethub_jax)/[\w./-]+\.(?:md|py|yaml|json))")
LINK_RE = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _refs(path: pathlib.Path):
    text = path.read_text()
    out = set(PATH_RE.findall(text))
    for target in LINK_RE.findall(text):
        if not target.startswith(("http://", "https://", "mailto:")):
            out.add((path.parent / target).resolve().relative_to(ROOT).as_posix())
    return out


def test_every_named_path_exists():
    docs = ["README.md", "DESIGN.md"] + sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))
    missing = [(d, r) for d in docs for r in sorted(_refs(ROOT / d)) if r not in BUILT and not (ROOT / r).exists()]
    assert not missing, f"docs name paths that do not exist: {missing}"


def test_every_doc_is_reachable_from_readme():
    seen, todo = {"README.md"}, ["README.md"]
    while todo:
        for r in _refs(ROOT / todo.pop()):
            if r.endswith(".md") and r not in seen and (ROOT / r).exists():
                seen.add(r)
                todo.append(r)
    orphans = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md")
                     if p.relative_to(ROOT).as_posix() not in seen)
    assert not orphans, f"docs not reachable from README.md: {orphans}"


def test_preset_table_matches_the_code():
    """docs/training.md "Model presets" is the one list of presets: its names are PRESETS' keys and its
    layer counts, widths and heads are the configs' (parameters checked to the 3 figures printed)."""
    from hethub_jax.models.config import PRESETS
    from hethub_jax.planner.analytic import stage_params
    text = (ROOT / "docs" / "training.md").read_text().split("#### Model presets", 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| `")]
    table = {r[0].strip().strip("`"): [c.strip() for c in r] for r in rows}
    assert set(table) == set(PRESETS)
    for name, cfg in PRESETS.items():
        row = table[name]
        params = stage_params(cfg, 0, cfg.num_hidden_layers - 1, True, True)
        value, unit = row[1].split()
        scale = {"M": 1e6, "B": 1e9}[unit]
        assert float(value) == float(f"{params / scale:.3g}"), (name, row[1], params)
        assert row[2:8] == [str(cfg.num_hidden_layers), str(cfg.hidden_size), str(cfg.intermediate_size),
                            f"{cfg.num_attention_heads} / {cfg.num_key_value_heads}", str(cfg.vocab_size),
                            str(cfg.max_position_embeddings)], name
