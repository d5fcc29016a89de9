"""How config values are read (core/config_values.py, core/config.py): `--set` text and YAML files into each field's
type, and what is refused at load with a one-line ConfigError (tests/test_cli_errors.py tries the same through the
real CLI)."""
import pytest

from core import config as C


# ---- text settings keep their text ----------------------------------------------------------------------------
@pytest.mark.parametrize("key,text", [
    ("actor.judge_mode", "off"), ("envd.auth_token", "0x1F"), ("envd.auth_token", "0755"), ("envd.auth_token", "{x}"),
    ("envd.auth_token", "#abc"), ("envd.auth_token", "*abc"), ("name", "1.10"), ("name", "[oops"), ("name", "yes"),
    ("name", "null"), ("sft.demonstrator", "noisy:0.5"),
])
def test_a_set_text_value_is_kept_as_written(key, text):
    sets = [f"{key}={text}"] + (["control.auth_token=c"] if key.endswith("auth_token") else [])
    node = C.load(None, None, sets)
    for part in key.split("."):
        node = getattr(node, part)
    assert node == text and type(node) is str


def test_a_set_value_of_another_type_is_still_yaml():
    cfg = C.load(None, None, ["learner.lr=1e-4", "actor.env_ids=[builtin/click, builtin/menu]", "learner.archive=on",
                              "actor.env_options={a: 1}", "actor.env_ids=builtin/click,builtin/menu"])
    assert cfg.learner.lr == 1e-4 and cfg.learner.archive is True and cfg.actor.env_options == {"a": 1}
    assert cfg.actor.env_ids == ["builtin/click", "builtin/menu"]
    assert C.load(None, None, ["envd.auth_token=", "control.auth_token="]).envd.auth_token == ""


@pytest.mark.parametrize("line,shown", [("judge_mode: off", "the boolean False"), ("system_prompt: 0755", "the number 493"),
                                        ("system_prompt: 0x1F", "the number 31"), ("system_prompt: {x}", "the mapping"),
                                        ("system_prompt: #x", "an empty (null) value")])
def test_a_yaml_file_text_setting_of_another_type_says_to_quote_it(tmp_path, line, shown):
    (tmp_path / "c.yaml").write_text(f"actor:\n  {line}\n")
    with pytest.raises(C.ConfigError, match="quote the value as written") as e:
        C.load(None, str(tmp_path / "c.yaml"))
    assert str(e.value).startswith("actor.") and shown in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "q.yaml").write_text('actor:\n  judge_mode: "off"\n  system_prompt: \'0755\'\n')
    cfg = C.load(None, str(tmp_path / "q.yaml"))
    assert (cfg.actor.judge_mode, cfg.actor.system_prompt) == ("off", "0755")


def test_a_saved_config_reads_back_the_same(tmp_path):
    """config.yaml of a run (C.save) quotes text that YAML would read as another type, so it loads unchanged."""
    cfg = C.load("quickstart", None, ["actor.judge_mode=off", "envd.auth_token=0755", "control.auth_token=0x1F",
                                      "name=1.10"])
    C.save(cfg, tmp_path / "c.yaml")
    assert C.load(None, str(tmp_path / "c.yaml")) == cfg


# ---- ports -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["learner.stream.port=65536", "envd.port=-1", "inference.port=70000",
                                     "telemetry.prometheus_port=65536", "inference.sglang_base_port=70000"])
def test_every_port_setting_is_a_tcp_port(setting):
    with pytest.raises(C.ConfigError, match=r"must be in \[-?[01], 65535\]"):
        C.load(None, None, [setting])
    with pytest.raises(C.ConfigError, match="last server's port 65536 is past 65535"):
        C.load(None, None, ["inference.sglang_launch=2", "inference.sglang_base_port=65535"])


def test_command_options_are_config_settings_checked_at_load():
    """`tars envd --port`, `tars serve --port/--engine/--sglang-launch/--sglang-url` go through the config checks."""
    from tars.cli import _load, build_parser

    a = build_parser().parse_args(["serve", "--model", "m", "--port", "5", "--engine", "sglang", "--sglang-url",
                                   "http://a:1", "--sglang-url", "http://b:2", "--sglang-launch", "0"])
    inf = _load(a).inference
    assert (inf.port, inf.engine, inf.sglang_urls, inf.sglang_launch) == (5, "sglang", ["http://a:1", "http://b:2"], 0)
    assert _load(build_parser().parse_args(["envd", "--port", "7"])).envd.port == 7
    for argv in (["envd", "--port", "70000"], ["envd", "--port", "-1"], ["serve", "--model", "m", "--port", "70001"]):
        with pytest.raises(C.ConfigError, match=r"port = -?\d+: must be in \[0, 65535\]"):
            _load(build_parser().parse_args(argv))


# ---- a --set value that is not YAML --------------------------------------------------------------------------------
@pytest.mark.parametrize("setting,needle", [("actor.env_ids=[oops", "actor.env_ids: '[oops' is not a valid YAML value"),
                                            ("learner.lr=*x", "learner.lr: '*x' is not a valid YAML value"),
                                            ("actor.env_options={a", "actor.env_options: '{a' is not a valid YAML"),
                                            ("learner.batch_size=.inf", "learner.batch_size: inf is not int")])
def test_a_set_value_that_cannot_be_read_is_a_config_error(setting, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, None, [setting])
    assert needle in str(e.value) and "\n" not in str(e.value)
