"""What a file holds is checked where it is read: configs, tensors, weights, metadata.

Each bad file is refused with one CheckpointError or HFFormatError naming the file and
what is wrong, before a model is built from it: never a model of NaNs that answers with
an empty text, never gigabytes allocated for a config that its tensors contradict.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAMILY_CFG, Family
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from smallem_cli.config import ConfigError, ModelConfig
from smallem_cli.engine import family as fam
from smallem_cli.interop import hf
from smallem_cli.interop.hf import HFFormatError
from smallem_cli.model import checkpoint
from smallem_cli.model.checkpoint import CheckpointError


def resave(
    src: Path, dst: Path, meta: dict | None = None, config: dict | None = None, tensors: dict | None = None
) -> Path:
    """A copy of a smallem file with metadata, config fields or tensors changed."""
    with safe_open(str(src), framework="pt") as f:
        old_meta = dict(f.metadata())
    cfg = json.loads(old_meta["config"]) | (config or {})
    new_meta = old_meta | {"config": json.dumps(cfg)} | (meta or {})
    save_file(load_file(src) | (tensors or {}), str(dst), metadata=new_meta)
    return dst


@pytest.fixture(scope="module")
def hf_dir(family: Family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "target-hf"
    hf.export_hf(family.target, out, family.tokenizer)
    return out


def hf_copy(hf_dir: Path, dst: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    shutil.copytree(hf_dir, dst)
    if config:
        raw = json.loads((dst / "config.json").read_text()) | config
        (dst / "config.json").write_text(json.dumps(raw))
    if tensors:
        weights = load_file(dst / "model.safetensors") | tensors
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def no_model_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a model with real weights fails the test: bad files are refused before.

    (A model on the meta device allocates nothing: the loaders build one to learn the shapes.)
    """

    def guard(cls: type) -> type:
        def build(*args: object) -> object:
            if torch.empty(0).device.type != "meta":
                raise AssertionError(f"a {cls.__name__} was built from a file that is then refused")
            return cls(*args)

        return build

    for module in (checkpoint, hf):
        monkeypatch.setattr(module, "Transformer", guard(module.Transformer))
    monkeypatch.setattr(checkpoint, "MTPModule", guard(checkpoint.MTPModule))


# --- configs --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_theta": -1}, r"rope_theta must be a finite number > 0, got -1"),
        ({"norm_eps": -1}, r"norm_eps must be a finite number > 0"),
        ({"norm_eps": 0}, r"norm_eps must be a finite number > 0"),
        ({"n_heads": 0}, r"n_heads must be between 1 and"),
        ({"dim": -8}, r"dim must be between 1 and .*got -8"),
        ({"max_seq_len": 10**12}, r"max_seq_len must be between 1 and 131,072"),
        ({"n_layers": 1000}, r"n_layers must be between 1 and 256"),
        ({"dim": "256"}, r"dim must be an integer, got '256' \(a string\)"),
        ({"vocab_size": 300.0}, r"vocab_size must be an integer, got 300\.0"),
        ({"n_kv_heads": True}, r"n_kv_heads must be an integer, got True"),
        ({"rope_theta": "1e4"}, r"rope_theta must be a number"),
        ({"tie_embeddings": 1}, r"tie_embeddings must be true or false"),
        ({"vocab_size": 1 << 20, "dim": 8192}, r"parameters, more than smallem's limit"),
    ],
)
def test_bad_config_fields_are_named(family: Family, tmp_path: Path, change: dict, message: str) -> None:
    raw = json.loads(FAMILY_CFG.to_json())
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_json(json.dumps(raw | change))
    bad = resave(family.target, tmp_path / "bad.safetensors", config=change)
    with pytest.raises(CheckpointError, match=str(bad).replace(".", r"\.") + r": bad config in metadata: .*" + message):
        checkpoint.load_model(bad)


def test_nan_in_a_config_is_refused() -> None:
    raw = json.loads(FAMILY_CFG.to_json())
    for field in ("rope_theta", "norm_eps"):
        for value in ("NaN", "Infinity"):
            with pytest.raises(ConfigError, match=field):
                ModelConfig.from_json(json.dumps(raw).replace(f'"{field}": {raw[field]}', f'"{field}": {value}'))


def test_configs_are_bounded_before_anything_is_built() -> None:
    """The rotary tables follow the config, not the file: their size is bounded too."""
    wide = dict(vocab_size=10, dim=8192, n_layers=1, n_heads=1, n_kv_heads=1, hidden_dim=8)
    with pytest.raises(ConfigError, match=r"max_seq_len 131072 x head_dim 8192 exceeds"):
        ModelConfig(**wide, max_seq_len=131072)
    ModelConfig(**wide, max_seq_len=2048)
    # a Llama 3.2 1B fits
    ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192, max_seq_len=131072)


def test_malformed_config_json_is_a_config_error() -> None:
    for text in ("{", "[1]", "null", '"x"', "[" * 100_000):
        with pytest.raises(ConfigError):
            ModelConfig.from_json(text)


def test_a_contradicted_config_allocates_nothing(family: Family, tmp_path: Path, monkeypatch) -> None:
    """n_layers 200 in the metadata of a 2-layer file: refused from the header, no model built."""
    bad = resave(family.target, tmp_path / "deep.safetensors", config={"n_layers": 200, "hidden_dim": 60000})
    no_model_built(monkeypatch)
    with pytest.raises(CheckpointError, match=r"tensors do not match its config"):
        checkpoint.load_model(bad)
    wide = resave(family.target, tmp_path / "wide.safetensors", config={"hidden_dim": 4096})
    with pytest.raises(CheckpointError, match=r"has shape \(64, 32\), config says \(4096, 32\)"):
        checkpoint.load_model(wide)


def test_hf_config_out_of_bounds_allocates_nothing(hf_dir: Path, tmp_path: Path, monkeypatch) -> None:
    deep = hf_copy(hf_dir, tmp_path / "deep", config={"num_hidden_layers": 200})
    no_model_built(monkeypatch)
    with pytest.raises(HFFormatError, match=r"weights do not fit config\.json"):
        hf.load_hf(deep)
    for change, named in [
        ({"rms_norm_eps": float("nan")}, r"norm_eps"),
        ({"rope_theta": float("inf"), "rope_parameters": None}, r"rope_theta"),
        ({"num_hidden_layers": 1000}, r"n_layers must be between 1 and 256"),
        ({"max_position_embeddings": 10**12}, r"max_seq_len"),
    ]:
        with pytest.raises(HFFormatError, match=named):
            hf.config_from_hf(json.loads((hf_dir / "config.json").read_text()) | change)


def test_hf_shard_index_must_name_files_in_the_folder(hf_dir: Path, tmp_path: Path) -> None:
    for weight_map in ([1, 2], {"embed_tokens.weight": 7}, {"x": "../model.safetensors"}):
        d = hf_copy(hf_dir, tmp_path / f"idx{len(list(tmp_path.iterdir()))}")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(HFFormatError, match=r"model\.safetensors\.index\.json"):
            hf.load_hf(d)


# --- weights ----------------------------------------------------------------------------------------
def test_nan_weights_are_refused(family: Family, hf_dir: Path, tmp_path: Path) -> None:
    w = load_file(family.target)["layers.0.q_proj.weight"].clone()
    w[3, 4] = float("nan")
    bad = resave(family.target, tmp_path / "nan.safetensors", tensors={"layers.0.q_proj.weight": w})
    with pytest.raises(CheckpointError, match=r"NaN or infinity"):
        checkpoint.load_model(bad)
    head = load_file(hf_dir / "model.safetensors")["model.norm.weight"].clone()
    head[0] = float("inf")
    folder = hf_copy(hf_dir, tmp_path / "inf-hf", tensors={"model.norm.weight": head})
    # refused where the weights are read: here, or as the native step lays them out
    with pytest.raises(CheckpointError, match=r"inf-hf/model.safetensors: weights contain NaN or infinity \(model"):
        hf.load_hf(folder)[0].materialize()


def test_integer_weights_are_refused(family: Family, hf_dir: Path, tmp_path: Path) -> None:
    ints = torch.zeros(FAMILY_CFG.dim, dtype=torch.int32)
    bad = resave(family.target, tmp_path / "int.safetensors", tensors={"norm.weight": ints})
    with pytest.raises(CheckpointError, match=r"norm\.weight has dtype I32"):
        checkpoint.load_model(bad)
    folder = hf_copy(hf_dir, tmp_path / "int-hf", tensors={"model.norm.weight": ints})
    with pytest.raises(HFFormatError, match=r"model\.norm\.weight has dtype I32"):
        hf.load_hf(folder)


# --- a proposer's token ranking ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rank",
    [[0, 1, 300], [5, 5, 6], [-1, 2], ["1", 2], [1.0], {"a": 1}, "not json"],
)
def test_bad_vocab_rank_is_refused(family: Family, tmp_path: Path, rank: object) -> None:
    raw = rank if isinstance(rank, str) else json.dumps(rank)
    bad = resave(family.draft, tmp_path / "ranked.safetensors", meta={"vocab_rank": raw})
    tgt = fam.load_target(family.target, torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"ranked\.safetensors: vocab_rank"):
        fam.load_proposer(str(bad), tgt, torch.device("cpu"), 20)


# --- messages that named the wrong thing --------------------------------------------------------------
def test_saving_to_a_folder_is_named(tmp_path: Path, family: Family) -> None:
    model, _ = checkpoint.load_model(family.target)
    for where in (Path("."), tmp_path):
        with pytest.raises(CheckpointError, match=r"is a folder: name the checkpoint file"):
            checkpoint.save(where, model)


def test_a_folder_given_as_a_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"is a folder, not a checkpoint file"):
        checkpoint.read_meta(tmp_path)


def test_permission_denied_is_not_reported_as_missing(family: Family, tmp_path: Path) -> None:
    locked = tmp_path / "locked.safetensors"
    shutil.copy(family.draft, locked)
    locked.chmod(0)
    code = (
        "import sys; from smallem_cli.model import checkpoint\n"
        "try: checkpoint.read_meta(sys.argv[1])\n"
        "except checkpoint.CheckpointError as e: print(e)\n"
    )
    argv = [sys.executable, "-c", code, str(locked)]
    if os.geteuid() == 0:  # root reads anything: drop the capabilities that let it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv")
        caps = "-dac_override,-dac_read_search"
        argv = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", *argv]
    env = os.environ | {"PYTHONPATH": str(Path(checkpoint.__file__).parent.parent)}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == f"cannot read checkpoint {locked}: Permission denied", out


def test_hf_target_has_no_default_proposer(family: Family, hf_dir: Path, tmp_path: Path) -> None:
    """Shipped names are looked up beside a smallem checkpoint, never beside an HF folder."""
    home = tmp_path / "models"
    folder = hf_copy(hf_dir, home / "target-hf")
    shutil.copy(family.mtp, home / "mtp.safetensors")  # a stranger's file in the folder's parent
    assert fam.default_proposer(folder, True) == fam.default_proposer(folder, False) == "none"
    assert fam.default_proposer(family.target, True) == "ngram+mtp"
    assert fam.default_proposer(family.target, False) == "mtp"
    tgt = fam.load_target(folder, torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"proposer 'mtp' is a shipped name.*give the proposer's path"):
        fam.load_proposer("mtp", tgt, torch.device("cpu"))
    fam.load_proposer(str(family.draft), tgt, torch.device("cpu"))  # by path: fine


@pytest.mark.parametrize("mtp", [False, True])
def test_expected_shapes_are_the_models_own(mtp: bool) -> None:
    """The shapes a file is checked against, from the config alone, are those of the model itself."""
    from smallem_cli.config import PRESETS, ModelConfig
    from smallem_cli.model.checkpoint import expected_shapes
    from smallem_cli.model.llama import MTPModule, Transformer

    for cfg in [*PRESETS.values(), ModelConfig(tie_embeddings=False, n_kv_heads=2)]:
        with torch.device("meta"):
            model = MTPModule(cfg) if mtp else Transformer(cfg)
        assert expected_shapes(cfg, mtp) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
