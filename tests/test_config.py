"""The config tree: YAML + dotted overrides, and errors that name the key, the file and the line."""

import pytest

from lopd.config import describe, load_config, to_yaml
from lopd.errors import ConfigError
from lopd.schema import Config


def test_defaults_yaml_and_overrides_compose(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_rollouts: 100\nmodel:\n  lora:\n    r: 4\n")
    cfg = load_config(path, ["train.max_rollouts=256", "model.lora.enabled=true", "algorithm.aggregation=sequence"])
    assert isinstance(cfg, Config)
    assert cfg.train.max_rollouts == 256 and cfg.model.lora.r == 4 and cfg.model.lora.enabled
    assert cfg.algorithm.aggregation.value == "sequence"
    assert cfg.rollout.group_size == Config().rollout.group_size


def test_schema_names_still_import_from_config():
    """The schema's names, imported from `lopd.config` as before `lopd.schema` existed (user code, and
    checkpoints pickled then), are the schema's; a name neither has is an AttributeError."""
    import pickle

    import lopd.config
    import lopd.schema
    from lopd.config import Config as Loaded, DistillTarget

    assert Loaded is lopd.schema.Config and DistillTarget is lopd.schema.DistillTarget
    old = pickle.dumps(DistillTarget.gated, protocol=0).replace(b"lopd.schema", b"lopd.config")
    assert b"lopd.config" in old and pickle.loads(old) is DistillTarget.gated
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        lopd.config.NoSuchName


def test_resolved_config_roundtrips(tmp_path):
    cfg = load_config(None, ["optim.lr=3e-4", "env.eval_splits=[test]"])
    (tmp_path / "r.yaml").write_text(to_yaml(cfg))
    again = load_config(tmp_path / "r.yaml")
    assert again == cfg


def test_unknown_key_names_the_key_and_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.max_rollout=3"])
    msg = str(e.value)
    assert "train.max_rollout" in msg and "max_rollouts" in msg and "micro_batch_size" in msg
    assert "\n" not in msg
    with pytest.raises(ConfigError, match="valid keys under '<root>'"):
        load_config(None, ["nosuch.key=1"])


def test_wrong_type_and_bad_choice_are_named():
    with pytest.raises(ConfigError, match="train.max_rollouts"):
        load_config(None, ["train.max_rollouts=lots"])
    with pytest.raises(ConfigError, match=r"expected one of \[token, sequence\]"):
        load_config(None, ["algorithm.aggregation=mean"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.max_rollouts"])


def test_yaml_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_rollouts: 5\n  seeed: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3: unknown config key 'train.seeed'"):
        load_config(path)
    path.write_text("train:\n  max_rollouts: five\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: bad value for 'train.max_rollouts'"):
        load_config(path)
    path.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_every_key_has_help():
    rows = describe()
    assert len(rows) > 30
    missing = [k for k, _, text in rows if not text]
    assert not missing, missing


def test_bundled_configs_load():
    from lopd.cli import CONFIG_DIR

    names = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
    assert "grpo.yaml" in names and "demo.yaml" in names
    from lopd.compare import cells, load_grid

    for p in CONFIG_DIR.glob("*.yaml"):
        if p.name.startswith("compare_"):  # grid files of `lopd compare`: every run's config must load
            assert cells(load_grid(p))
        else:
            load_config(p)


def test_unknown_key_suggests_the_closest_full_key(tmp_path):
    for given, meant in [("train.max_rollout=3", "train.max_rollouts"), ("max_rollouts=3", "train.max_rollouts"),
                         ("rollout.group=4", "rollout.group_size"), ("algorithm.lopd.latent_token=8",
                                                                     "algorithm.lopd.latent_tokens")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [given])
        assert f"did you mean '{meant}'?" in str(e.value) and "\n" not in str(e.value), str(e.value)
    path = tmp_path / "typo.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"typo.yaml:2: unknown config key 'optim.learning_rate'"):
        load_config(path)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["zzzz.qqqq=1"])
    assert "did you mean" not in str(e.value)


def test_include_takes_a_bundled_name_like_config_does(tmp_path):
    (tmp_path / "mine.yaml").write_text("include: lopd\ntrain:\n  max_rollouts: 8\n")
    assert load_config(tmp_path / "mine.yaml") == load_config("lopd", ["train.max_rollouts=8"])
    (tmp_path / "lopd").write_text("train:\n  seed: 5\n")  # a file next to the including one wins
    assert load_config(tmp_path / "mine.yaml").train.seed == 5
    (tmp_path / "bad.yaml").write_text("# a comment\ninclude: [grpo, nosuch]\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: include 'nosuch': no such file .* and no bundled config"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("include: gone.yaml\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:1: include 'gone.yaml': no such file .*gone.yaml and no bundled"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("include: sub/grpo.yaml\n")  # a path is a path: never the bundled grpo
    with pytest.raises(ConfigError, match=r"bad.yaml:1: include 'sub/grpo.yaml': no such file .*grpo.yaml$"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "mine.yaml").write_text("include: lopd.yaml\ntrain:\n  max_rollouts: 8\n")  # the file name, too
    assert load_config(tmp_path / "mine.yaml") == load_config("lopd", ["train.max_rollouts=8"])


def test_a_bundled_config_file_name_resolves_where_no_such_file_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `--config demo.yaml` (a grid's `base: demo.yaml`) away from configs/
    assert load_config("demo.yaml") == load_config("demo")
    (tmp_path / "demo.yaml").write_text("train:\n  seed: 7\n")  # a file of that name here wins
    assert load_config("demo.yaml").train.seed == 7
    with pytest.raises(ConfigError, match="no such config file"):
        load_config("elsewhere/demo.yaml")


@pytest.mark.parametrize("args", [
    ["train", "--config", "grpo", "train.max_rollout=1"],
    ["train", "--config", "grpo", "train.max_rollouts=lots"],
    ["train", "--config", "nosuch"],
    ["train", "runs/nosuch_run_dir"],
    ["eval", "--model", "tiny", "eval.max_task=3"],
    ["compare", "--config", "nosuch"],
])
def test_cli_config_errors_come_before_torch_is_imported(args):
    """A config error is one line in well under a second and a half: nothing heavy is imported to find it."""
    import subprocess
    import sys

    code = ("import sys; from lopd.cli import main; rc = main(sys.argv[1:]); "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'numpy'}); "
            "print(rc, heavy)")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "2 []", (out.stdout, out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("lopd: error: "), out.stderr


def _help(capsys, *command: str) -> list[str]:
    from lopd.cli import main

    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return capsys.readouterr().out.splitlines()


def test_help_is_grouped_wrapped_and_lists_every_key(capsys):
    for command in ([], ["train"], ["eval"], ["compare"], ["bank"], ["inspect"], ["demo"]):
        wide = [line for line in _help(capsys, *command) if len(line) > 100]
        assert not wide, (command, wide)
    lines = _help(capsys, "train")
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("config keys")) + 1:]
    listed = {line.split()[0].split("=")[0] for line in lines if line.startswith("  ") and "=" in line.split()[0]}
    assert listed == {key for key, _, _ in describe()}
    headings = [line[:-1] for line in lines if line.endswith(":") and not line.startswith(" ")]
    assert [h for h in headings if "." not in h] == ["run", "model", "env", "rollout", "algorithm", "optim", "train",
                                                     "eval"]
    assert {"algorithm.pg", "algorithm.lopd", "model.lora"} <= set(headings)
    meaning_starts = {len(line) - len(line.lstrip()) for line in lines if line.startswith("   ")}
    assert meaning_starts <= {6, 42}  # hanging indents: a wrapped default, or the meaning's column


def test_eval_help_lists_only_what_evaluation_reads(capsys):
    text = "\n".join(_help(capsys, "eval"))
    assert "model.name=" in text and "eval.max_tasks=" in text and "rollout.max_new_tokens=" in text
    assert "env.toolworld.seed=" in text and "train.device=" in text
    assert "algorithm." not in text and "optim." not in text and "train.max_rollouts" not in text
