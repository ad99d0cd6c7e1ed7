"""docs/ppo_details.md keeps up with the code: every logged metric is explained there, and every
``homerlhf.module:function`` it names exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from homerlhf.ppo.metrics import METRIC_DESCRIPTIONS, read_metrics

ROOT = Path(__file__).resolve().parents[1]
PPO_DETAILS = ROOT / "docs" / "ppo_details.md"
# homerlhf.pkg.module:attr or homerlhf.pkg.module:Class.method
REFERENCE = re.compile(r"\b(homerlhf(?:\.\w+)+):(\w+(?:\.\w+)*)")


def _doc() -> str:
    return PPO_DETAILS.read_text()


def _undocumented(names) -> list[str]:
    text = _doc()
    # A metric counts as explained when it appears as code (`name`), as in the metric tables.
    return sorted(name for name in names if f"`{name}`" not in text)


def test_every_metric_in_metric_descriptions_is_explained():
    assert len(METRIC_DESCRIPTIONS) >= 20  # the real table, not an empty stand-in
    assert _undocumented(METRIC_DESCRIPTIONS) == []


def test_every_metric_name_in_the_doc_tables_is_a_real_metric():
    """The tables list metrics that exist: a renamed metric must not leave a stale row behind."""
    rows = re.findall(r"^\| `(\w+)` \|", _doc(), re.M)
    assert rows, "no metric tables found"
    assert sorted(set(rows) - set(METRIC_DESCRIPTIONS)) == []
    assert len(rows) == len(set(rows)), "a metric has two rows"


@pytest.fixture(scope="module")
def one_iteration_run(tmp_path_factory, tiny_llama_dir):
    """A real 1-iteration PPO run (NF4 tiny policy, adapter-off reference, tiny HF reward model)."""
    from homerlhf.config import load_config
    from homerlhf.stages.ppo import run_ppo
    from homerlhf.tiny import build_sequence_classifier

    rm_dir = build_sequence_classifier(tmp_path_factory.mktemp("docs-rm"), arch="llama", seed=3)
    cfg = load_config("cpu-tiny", overrides=[
        f"model.name_or_path={tiny_llama_dir}", "ref.backend=adapter_off", "reward.backend=hf",
        f"reward.model={rm_dir}", "rollout.batch_size=2", "rollout.chunk_size=2", "rollout.max_new_tokens=3",
        "rollout.max_prompt_len=16", "ppo.mini_batch_size=2", "ppo.micro_batch_size=2", "ppo.epochs=1",
        "ppo.iterations=1", "logging.samples_per_iteration=1", "logging.progress=false",
    ])
    run_dir = tmp_path_factory.mktemp("docs-run") / "run"
    run_ppo(cfg, out_dir=run_dir)
    return run_dir


def test_every_metric_written_by_a_real_run_is_explained(one_iteration_run):
    rows = read_metrics(one_iteration_run)
    assert len(rows) == 1
    assert len(rows[0]) >= 20
    assert _undocumented(rows[0]) == []


def test_every_metric_family_is_explained():
    from homerlhf.ppo.metrics import METRIC_FAMILIES, is_documented

    assert _undocumented(METRIC_FAMILIES) == []
    assert is_documented("reward_exact_answer") and is_documented("reward_rm_none")
    assert not is_documented("reward_Bad") and not is_documented("rewards_x")


def _missing(refs) -> list[str]:
    missing = []
    for module_name, attr_path in refs:
        try:
            obj = importlib.import_module(module_name)
        except ImportError as exc:
            missing.append(f"{module_name}:{attr_path} (module: {exc})")
            continue
        for part in attr_path.split("."):
            if not hasattr(obj, part):
                missing.append(f"{module_name}:{attr_path}")
                break
            obj = getattr(obj, part)
    return missing


def test_every_referenced_function_exists():
    refs = sorted(set(REFERENCE.findall(_doc())))
    assert len(refs) >= 30  # the doc names the implementing function of each detail
    assert _missing(refs) == []


@pytest.mark.parametrize("name", ["rewards.md", "data.md", "time.md", "app.md", "export.md", "demo.md", "moe.md"])
def test_functions_named_in_other_docs_exist(name):
    refs = sorted(set(REFERENCE.findall((ROOT / "docs" / name).read_text())))
    assert refs and _missing(refs) == []


def test_the_reference_pattern_catches_a_bad_name():
    """The check above can fail: a made-up name is found by the pattern and is not in the package."""
    refs = REFERENCE.findall("see `homerlhf.ppo.math:no_such_function` and homerlhf.ppo.kl:AdaptiveKLController.update")
    assert refs == [("homerlhf.ppo.math", "no_such_function"), ("homerlhf.ppo.kl", "AdaptiveKLController.update")]
    assert not hasattr(importlib.import_module("homerlhf.ppo.math"), "no_such_function")


def test_readme_links_the_docs_and_notebooks_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)\)", readme)
    local = [link for link in links if "://" not in link]
    for required in ("docs/ppo_details.md", "docs/workers.md", "docs/memory.md", "docs/errors.md", "docs/guide.md",
                     "docs/status.md", "docs/demo.md", "docs/README.md",
                     "notebooks/quickstart.ipynb", "notebooks/memory_planning.ipynb"):
        assert required in local, required
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_the_docs_index_lists_every_doc_once_in_one_line():
    index = (ROOT / "docs" / "README.md").read_text().splitlines()
    entries = [re.match(r"^- \[([\w.]+\.md)\]\(\1\): \S.*$", line) for line in index if line.startswith("- ")]
    assert all(entries), [line for line in index if line.startswith("- ")]
    listed = [m.group(1) for m in entries]
    docs = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert sorted(listed) == docs and len(listed) == len(set(listed))


def _links(path: Path) -> list[tuple[str, str]]:
    """(target, anchor) of each relative markdown link in ``path``, outside code blocks and spans."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [tuple(t.partition("#")[::2]) for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t
            and not t.startswith("mailto:")]


def test_every_relative_link_in_readme_and_docs_resolves_to_a_file_and_heading():
    """README and every doc: a moved section (the demo's tuning logs, the status table) leaves no dead link."""
    from test_status_table import sections

    broken = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in _links(path):
            file = (path.parent / target).resolve() if target else path
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in sections(file)):
                broken.append(f"{path.relative_to(ROOT)}: {target}#{anchor}")
    assert broken == []
