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


@pytest.mark.parametrize("text,shown", [("actor:\n  judge_mode: off", "actor.judge_mode: YAML read this value as the "
                                        "boolean False"), ("model:\n  path: 0755", "model.path: YAML read this value as "
                                        "the number 493"), ("name: 0x1F", "name: YAML read this value as the number 31"),
                                        ("model:\n  path: {x}", "the mapping"), ("name: #x", "an empty (null) value")])
def test_a_yaml_file_text_setting_of_another_type_says_to_quote_it(tmp_path, text, shown):
    (tmp_path / "c.yaml").write_text(text + "\n")
    with pytest.raises(C.ConfigError, match="quote the value as written") as e:
        C.load(None, str(tmp_path / "c.yaml"))
    assert shown in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "q.yaml").write_text('actor:\n  judge_mode: "off"\nmodel:\n  path: \'0755\'\n')
    cfg = C.load(None, str(tmp_path / "q.yaml"))
    assert (cfg.actor.judge_mode, cfg.model.path) == ("off", "0755")


def test_a_saved_config_reads_back_the_same(tmp_path):
    """config.yaml of a run (C.save) quotes text that YAML would read as another type, so it loads unchanged."""
    cfg = C.load("quickstart", None, ["actor.judge_mode=off", "envd.auth_token=0755", "control.auth_token=0x1F",
                                      "name=1.10"])
    C.save(cfg, tmp_path / "c.yaml")
    assert C.load(None, str(tmp_path / "c.yaml")) == cfg


# ---- ports -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["learner.stream.port=65536", "envd.port=-1", "inference.port=70000",
                                     "inference.sglang_base_port=70000"])
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


# ---- choice settings are checked at load ----------------------------------------------------------------------------
@pytest.mark.parametrize("key,bad,allowed", [
    ("learner.algo", "PPO", "ppo | grpo"), ("actor.on_parse_error", "Stop", "continue | stop"),
    ("actor.judge_mode", "False", "off | replace | add"), ("actor.judge_on_error", "drop", "infra_error | env"),
    ("actor.system_prompt", "computre", "auto | tiny | none | computer | browser | mobile"),
    ("actor.coordinates", "pixels", "auto | absolute | relative | screen"),
    ("actor.on_context_full", "wrap", "window | truncate"), ("inference.engine", "vllm", "local | sglang"),
    ("learner.stream.durability", "none", "wal | checkpoint"), ("learner.stream.wal_writer", "proc", "process | thread"),
    ("inference.sglang_pause_mode", "pause", "abort | retract | in_place"),
])
def test_a_choice_setting_outside_its_choices_is_refused_at_load(tmp_path, key, bad, allowed):
    """learner.algo=PPO trained GRPO without a critic, actor.on_parse_error=Stop went on; the actor's own checks of
    judge_mode, system_prompt, coordinates and judge_on_error ran only after `tars up` had started (and its SFT)."""
    with pytest.raises(C.ConfigError, match=f"^{key} = '{bad}': must be one of {allowed}$".replace("|", r"\|")):
        C.load(None, None, [f"{key}={bad}"])
    section, _, name = key.rpartition(".")
    (tmp_path / "c.yaml").write_text("".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(section.split(".")))
                                     + f"{'  ' * (section.count('.') + 1)}{name}: '{bad}'\n")
    with pytest.raises(C.ConfigError, match="must be one of"):
        C.load(None, str(tmp_path / "c.yaml"))
    for good in allowed.split(" | "):
        C.load(None, None, [f"{key}={good}", "envd.auth_token=", "inference.sglang_urls=[]"])


def test_learner_config_error_names_the_algorithms():
    """PPOTrainer raises LearnerConfig.config_error() for a config built in code, past the loader's checks."""
    assert "learner.algo: 'PPO' is not one of ppo | grpo" == C.LearnerConfig(algo="PPO").config_error()


def test_the_actors_choices_are_the_configs():
    """The actor keeps its own checks (core cannot import the actor): the two lists must agree."""
    import dataclasses

    from actor.tiny import SYSTEM_PROMPTS
    from actor.uitars import COORDINATES

    fields = {fl.name: fl.metadata.get("choices") for fl in dataclasses.fields(C.ActorConfig)}
    assert set(fields["system_prompt"]) == set(SYSTEM_PROMPTS) and set(fields["coordinates"]) == set(COORDINATES)


# ---- bounds and finite numbers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting,needle", [
    ("actor.retries=-1", "actor.retries = -1: must be >= 0"),  # every envd call returned None
    ("learner.checkpoint.every=0", "learner.checkpoint.every = 0: must be >= 1"),  # ZeroDivisionError after update 1
    ("learner.ppo.epochs=0", "learner.ppo.epochs = 0: must be >= 1"),
    ("learner.group.size=0", "learner.group.size = 0: must be >= 1"),
    ("actor.send_window=0", "actor.send_window = 0: must be >= 1"),
    ("learner.lr=nan", "learner.lr = nan: must be a finite number"),  # NaN passes lo=0
    ("telemetry.sample_ratio=nan", "telemetry.sample_ratio = nan: must be a finite number"),  # and lo=0, hi=1
    ("actor.temperature=.inf", "actor.temperature = inf: must be a finite number"),
    ("learner.ppo.gamma=-.inf", "learner.ppo.gamma = -inf: must be a finite number"),
])
def test_values_outside_what_the_code_can_run_are_refused_at_load(tmp_path, setting, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, None, [setting])
    assert str(e.value) == needle
    key, _, value = setting.partition("=")
    *section, name = key.split(".")
    (tmp_path / "c.yaml").write_text("".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(section))
                                     + f"{'  ' * len(section)}{name}: {value}\n")
    with pytest.raises(C.ConfigError, match="must be"):
        C.load(None, str(tmp_path / "c.yaml"))
    assert C.load(None, None, ["actor.retries=0", "learner.checkpoint.every=1"]).actor.retries == 0
