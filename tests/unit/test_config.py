"""The real conf/ composes for every group option; sections validate; bad values are named."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pipeline.config import compose, ollama, schema
from pipeline.errors import UserError
from pipeline.tools import cli
from tests.helpers import conf
from tests.helpers.ollama import ollama_store

REPO = Path(__file__).resolve().parents[2]
GROUPS = sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir())


def test_groups_are_the_designed_ones():
    assert GROUPS == ["attribution", "capture", "checks", "equivalence", "executor", "lens", "model", "probs", "prompt",
                      "report", "sampling"]


# Options that leave a value to the user (`???`), with one supplied; their files also interpolate or extend
# another option, so they are compared key by key with what was supplied.
SUPPLIED = {("model", "local"): {"model.source.path": "models/mine"}, ("model", "hub"): {"model.source.hub_id": "o/n"},
            ("model", "tiny"): {"model.source.family": "gpt2"},
            ("model", "gguf"): {"model.source.path": "models/my.gguf"},
            ("model", "ollama"): {"model.source.name": "smollm2:135m"}}


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS
                                          for p in sorted((REPO / "conf" / g).glob("*.yaml"))])
def test_every_group_option_composes_and_validates(tmp_path, monkeypatch, group, option):
    supplied = SUPPLIED.get((group, option), {})
    if (group, option) == ("model", "ollama"):       # the name is resolved to its blob when conf/ is composed
        monkeypatch.setenv(ollama.ENV, str(ollama_store(tmp_path / "models", "library/smollm2/135m")))
    params = compose.compose_to(tmp_path / "params.yaml", [f"{group}={option}",
                                                          *(f"{k}={v}" for k, v in supplied.items())], REPO)
    for section in schema.SECTIONS:
        assert schema.load_section(params, section) is not None
    if not supplied:
        assert params[group] == conf.option(group, option)     # the file, over the option it extends
        return
    for key, value in supplied.items():
        node = params
        for part in key.split("."):
            node = node[part]
        assert node == value
    assert params["model"]["source"]["kind"] == option


@pytest.mark.parametrize("option", ["local", "hub", "tiny", "gguf", "ollama"])
def test_an_option_that_leaves_a_value_to_the_user_says_which(tmp_path, option):
    key = next(iter(SUPPLIED[("model", option)]))
    with pytest.raises(UserError, match=rf"^{key}='\?\?\?' is not allowed: a value: the chosen config option "):
        compose.compose_to(tmp_path / "params.yaml", [f"model={option}"], REPO)


def test_committed_params_yaml_is_the_composition_of_conf():
    assert compose.check(REPO, REPO / "params.yaml") == ([], [])    # and its record says: no overrides


def test_check_names_the_differing_key(tmp_path):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["sampling"]["top_p"] = 0.5
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, allow_unicode=True))
    assert compose.check(REPO, tmp_path / "params.yaml") == (["sampling.top_p"], [])


def test_check_composes_with_the_recorded_overrides(tmp_path, monkeypatch):
    """`make repro` runs `compose --check`: a workspace composed for tiny_qwen2 (or any
    overrides) is in step, and stays so until conf/ or params.yaml changes."""
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    monkeypatch.chdir(tmp_path)
    overrides = ["model=tiny_qwen2", "sampling.top_k=3", "prompt.text='Hi (there), it\\'s me = 🍕'"]
    assert cli.main(["compose", *overrides]) == 0
    assert compose.recorded_overrides(tmp_path / "params.yaml") == overrides
    assert cli.main(["compose", "--check"]) == 0                    # was 1 (compared with conf's defaults)
    conf = tmp_path / "conf/sampling/reference.yaml"
    conf.write_text(conf.read_text().replace("top_p: 1.0", "top_p: 0.8"))
    assert compose.check(tmp_path, tmp_path / "params.yaml") == (["sampling.top_p"], overrides)
    assert cli.main(["compose", "--check"]) == 1
    assert cli.main(["compose", "model=tiny_qwen2"]) == 0            # recomposed: a new record
    assert compose.check(tmp_path, tmp_path / "params.yaml") == ([], ["model=tiny_qwen2"])
    (tmp_path / compose.RECORD).write_text("overrides: 5\n")
    assert cli.main(["compose", "--check"]) == 2                      # a damaged record: one line, exit 2


def test_compose_refuses_a_local_model_folder_that_does_not_exist(tmp_path, monkeypatch, capsys):
    """`compose model=local model.source.path=/no/such/dir` exits 2 with one line naming the path and leaves
    params.yaml and its record as they were (issue 50); a folder that exists composes, whatever it holds: what is
    in it is the validate stage's to decide."""
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["compose", "model=tiny_qwen2"]) == 0
    before = {name: (tmp_path / name).read_bytes() for name in ("params.yaml", compose.RECORD)}
    capsys.readouterr()
    for path in (str(tmp_path / "no/such/dir"), "models/typo"):
        assert cli.main(["compose", "model=local", f"model.source.path={path}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"nexttoken compose: error: model.source.path={path!r}: "
                                                       f"no such folder ({(tmp_path / path).resolve()})"), err
        assert {name: (tmp_path / name).read_bytes() for name in before} == before
    (tmp_path / "models/mine").mkdir(parents=True)            # empty: validate refuses it, compose does not
    assert cli.main(["compose", "model=local", "model.source.path=models/mine"]) == 0
    assert yaml.safe_load((tmp_path / "params.yaml").read_text())["model"]["source"]["path"] == "models/mine"


def test_a_section_no_stage_reads_is_refused(tmp_path):
    """A hand-edited params.yaml with `foo: 1` is refused by every reader, as unknown keys are."""
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text() + "foo: 1\n")
    with pytest.raises(UserError, match=r"^foo=1 is not allowed: a known section: model, prompt, capture"):
        schema.read_params(tmp_path / "params.yaml")


def test_a_key_conf_does_not_set_is_added_with_plus(tmp_path, monkeypatch):
    """What Hydra (and so `dvc exp run -S`) says about a key conf/ lacks, in one line naming `+`."""
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    model = conf / "model/tiny.yaml"          # tiny_qwen2 extends it
    model.write_text(model.read_text().replace("reference_figures: null", ""))
    with pytest.raises(UserError, match=r"^model.reference_figures='seed_article' is not allowed: a key conf/ "
                                        r"sets; add one it does not set as \+model.reference_figures=seed_article$"):
        compose.compose_to(tmp_path / "p.yaml", ["model=tiny_qwen2", "model.reference_figures=seed_article"], tmp_path)
    params = compose.compose_to(tmp_path / "p.yaml", ["model=tiny_qwen2", "+model.reference_figures=seed_article"],
                                tmp_path)
    assert params["model"]["reference_figures"] == "seed_article"


def test_unknown_model_lists_the_options(tmp_path):
    with pytest.raises(UserError, match=r"model='nope'.*gemma3_270m, gguf, hub, local, ollama, qwen2_5_7b, "
                                        r"smollm2_135m_instruct, tiny, tiny_qwen2"):
        compose.compose_to(tmp_path / "p.yaml", ["model=nope"], REPO)


def _params():
    return yaml.safe_load((REPO / "params.yaml").read_text())


@pytest.mark.parametrize("section,key,value,match", [
    ("prompt", "text", "", "prompt.text=''"),
    ("prompt", "text", "   ", "prompt.text='   '"),
    ("sampling", "temperature", -0.1, "sampling.temperature=-0.1"),
    ("sampling", "top_p", 0.0, "sampling.top_p=0.0"),
    ("sampling", "top_p", 1.5, "sampling.top_p=1.5"),
    ("sampling", "top_k", -1, "sampling.top_k=-1"),
    ("sampling", "top_k", True, "sampling.top_k=True"),
    ("sampling", "max_new_tokens", -1, "sampling.max_new_tokens=-1"),
    ("sampling", "seed", 1.5, "sampling.seed=1.5"),
    ("sampling", "seed", "abc", "sampling.seed='abc'"),
    ("capture", "dtype", "int8", "capture.dtype='int8'"),
    ("capture", "device", "tpu", "capture.device='tpu'"),
    ("capture", "attention_layers", [0, "x"], "capture.attention_layers='x'"),
    ("capture", "positions", "middle", "capture.positions='middle'"),
    ("probs", "temperatures", [0.0], "probs.temperatures=0.0"),
    ("probs", "positions", [], "probs.positions=\\[\\]"),
    ("checks", "kv_cache_atol", -1.0, "checks.kv_cache_atol=-1.0"),
    ("sampling", "typo_key", 1, "sampling.typo_key=1"),
])
def test_bad_values_are_named(section, key, value, match):
    params = _params()
    params[section][key] = value
    with pytest.raises(UserError, match=match):
        schema.load_section(params, section)


def test_subset_takes_exactly_the_named_keys():
    params = _params()
    sub = schema.subset(params, ("model.name", "model.tokenizer", "prompt"))
    assert sub == {"model": {"name": params["model"]["name"], "tokenizer": params["model"]["tokenizer"]},
                   "prompt": params["prompt"]}
    with pytest.raises(UserError, match="model.nope"):
        schema.subset(params, ("model.nope",))


def _tiny_source(**changes) -> dict:
    return {**conf.option("model", "tiny_qwen2")["source"], **changes}


@pytest.mark.parametrize("changes, match", [
    ({"kind": "onnx"}, r"^model\.source\.kind='onnx' is not allowed: one of gguf, ollama, tiny, local, hub$"),
    ({"kind": None}, r"^model\.source\.kind=None is not allowed: one of gguf, ollama, tiny, local, hub$"),
    ({"seed": None}, r"^model\.source\.seed=None is not allowed: an integer >= 0$"),
    ({"seed": True}, "model.source.seed=True"),
    ({"architecture": {"hidden_size": 64}}, "model.source.architecture.intermediate_size is missing"),
    ({"pip": None}, "model.source.pip=None"),
    ({"family": None}, r"^model\.source\.family=None is not allowed: a non-empty string$"),
    # a key of another kind: null is dropped, a value would be ignored, so it is refused, naming both kinds
    ({"path": "models/mine"}, r"^model\.source\.path='models/mine' is not allowed: null with kind=tiny, which "
                              r"does not read it \(a key of kind=gguf, local; kind=tiny reads architecture, family, "),
    ({"revision": "v1"}, r"^model\.source\.revision='v1' is not allowed: null with kind=tiny, .* kind=hub;"),
    ({"nope": 1}, r"^model\.source\.nope=1 is not allowed: a known key: architecture, family, files, kind, package"),
])
def test_bad_sources_are_named(changes, match):
    with pytest.raises(UserError, match=match):
        schema.parse(schema.SourceConfig, _tiny_source(**changes), "model.source")
    raw = {**conf.option("model", "tiny_qwen2"), "source": _tiny_source(**changes)}
    with pytest.raises(UserError, match=match):          # the same line through the section, as validate reads it
        schema.parse(schema.ModelConfig, raw, "model")


def test_each_kind_takes_its_own_keys_and_null_for_the_others():
    """model.source is one class per kind; tiny_qwen2 is `tiny` with family qwen2. Another kind's key given
    as null (conf/model/*.yaml write them all) is dropped, so switching kind by overrides keeps working."""
    tiny = schema.parse(schema.SourceConfig, _tiny_source(), "model.source")
    assert type(tiny) is schema.TinySource and (tiny.kind, tiny.family) == ("tiny", "qwen2")
    assert not hasattr(tiny, "hub_id") and not hasattr(tiny, "path")
    nulls = dict.fromkeys(("package", "pip", "seed", "architecture", "family"))
    hub = schema.parse(schema.SourceConfig, _tiny_source(kind="hub", hub_id="o/n", **nulls), "model.source")
    assert type(hub) is schema.HubSource and (hub.hub_id, hub.revision, hub.files) == \
        ("o/n", None, "conf/model/tiny_qwen2.yaml")
    local = schema.parse(schema.SourceConfig, {"kind": "local", "path": "models/mine", "hub_id": None},
                         "model.source")
    assert type(local) is schema.LocalSource and local.path == "models/mine" and not hasattr(local, "hub_id")
    assert schema.known_keys("model.source") == sorted(schema.SOURCE_KEYS)


def test_sections_are_frozen_copies():
    arch = dict(_tiny_source()["architecture"])
    source = schema.parse(schema.SourceConfig, _tiny_source(architecture=arch), "model.source")
    with pytest.raises(ValidationError, match="frozen"):
        source.seed = 1
    arch["hidden_size"] = 1
    assert source.architecture.hidden_size == 64 and source.architecture.lm_head_std == 0.5
