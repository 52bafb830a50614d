"""The documentation cites only files that exist (tools/check_doc_links.py): README.md, NOTES.md, docs/,
tools/README.md and examples/README.md name results, scripts and sources by repository path; a move or a pruned
results file must update them. CPU only, no jax_flash import."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_doc_links", ROOT / "tools" / "check_doc_links.py")
check_doc_links = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_doc_links)


def test_every_cited_path_exists():
    missing = check_doc_links.missing(str(ROOT))
    assert not missing, "documentation cites paths that do not exist:\n" + "\n".join(missing)


def test_docs_cite_results():
    # The check sees the README's plot and table; a regex that matched nothing would pass vacuously.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert any(p.startswith("benchmarks/results/") for _, _, p in check_doc_links.citations(readme))


def test_checker_catches_missing_and_skips_history(tmp_path):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "run.md").write_text("")
    (tmp_path / "benchmarks" / "results" / "run.json").write_text("")
    (tmp_path / "README.md").write_text(
        "Table `benchmarks/results/run.{md,json}`, plot ![p](benchmarks/results/run.png).\n"
        "Old: `c96edda:benchmarks/results/gone.md`; per device `benchmarks/results/<device>.md`; "
        "ratio jax_flash/cudnn; `tools/*.sh`.\n")
    assert check_doc_links.missing(str(tmp_path)) == [
        "README.md:1: benchmarks/results/run.png", "README.md:2: tools/*.sh"]
