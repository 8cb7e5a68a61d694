"""Fault injection specs: one grammar for the trainer and the simulator (trainer/faults.py).

Covered: trainer.faults.parse on every kind of the grammar (values, their
types, the rank they apply to, the steps `active()` selects); malformed specs
(unknown kind, missing key, value of the wrong type, unknown key, no `=`)
raising ValueError that names the problem; the trainer's own argument check,
which accepts the kinds it injects and refuses the simulator's; and
`rankwatch train` with a bad spec (one-line error, exit 2, before torchrun)
and with a simulator-only spec (refused, pointing at `rankwatch simulate`).
"""

import subprocess

import pytest

from tests.support.collectors import free_port
from tests.support.commands import rankwatch_cli
from trainer.faults import Fault, parse

# spec -> (kind, params, rank, steps where active, steps where not)
GRAMMAR = {
    "straggler:rank=2,slowdown=1.3,from=40": (
        "straggler",
        {"rank": 2, "slowdown": 1.3, "from": 40},
        2,
        [40, 41, 1000, 10**9],
        [0, 39],
    ),
    "straggler:rank=2,slowdown=1.3,from=40,to=90": (
        "straggler",
        {"rank": 2, "slowdown": 1.3, "from": 40, "to": 90},
        2,
        [40, 89],
        [39, 90, 200],
    ),
    "hang:rank=1,at=200": ("hang", {"rank": 1, "at": 200}, 1, [200], [0, 199, 201]),
    "hang:rank=1,at=200,seconds=30": ("hang", {"rank": 1, "at": 200, "seconds": 30.0}, 1, [200], [199, 201]),
    "spike:at=120,scale=8": ("spike", {"at": 120, "scale": 8.0}, None, [120], [0, 119, 121]),
    "nan:at=150": ("nan", {"at": 150}, None, [150], [0, 149, 151]),
    "crash:rank=1,at=50": ("crash", {"rank": 1, "at": 50}, 1, [50], [0, 49, 51]),
    "thermal:rank=3,from=60": ("thermal", {"rank": 3, "from": 60}, 3, [60, 61, 5000], [0, 59]),
    "slow-link:rank=5,factor=2": ("slow-link", {"rank": 5, "factor": 2.0}, 5, [0, 1, 10**6], []),
    "slow-stage:stage=3,slowdown=1.2": ("slow-stage", {"stage": 3, "slowdown": 1.2}, None, [0, 77], []),
    "data-skew:cv=0.3": ("data-skew", {"cv": 0.3}, None, [0, 12345], []),
}


@pytest.mark.parametrize("spec", sorted(GRAMMAR))
def test_parse_grammar(spec):
    kind, params, rank, active, inactive = GRAMMAR[spec]
    fault = parse(spec)
    assert isinstance(fault, Fault)
    assert fault.kind == kind and fault.spec == spec
    assert dict(fault.params) == params
    for key, value in params.items():
        assert fault.get(key) == value and type(fault.get(key)) is type(value), key
    assert fault.rank == rank
    assert [s for s in active if fault.active(s)] == active
    assert [s for s in inactive if fault.active(s)] == []


def test_parse_details():
    f = parse("  straggler:slowdown=1.5,rank=0  ")
    assert f.spec == "straggler:slowdown=1.5,rank=0"  # stripped, as logged in fault_injected events
    assert f.get("from") is None and f.get("from", 0) == 0 and f.active(0)
    assert parse("straggler:rank=0,slowdown=1.5") == parse("straggler:rank=0,slowdown=1.5")  # hashable, equal
    assert parse("spike:at=3,scale=8").get("scale") == 8.0
    assert type(parse("spike:at=3,scale=8").get("scale")) is float  # "8" read as the declared float


@pytest.mark.parametrize(
    "spec, words",
    [
        ("bogus:x=1", ["unknown fault", "'bogus'", "straggler", "data-skew"]),
        ("stragler:rank=1,slowdown=2", ["unknown fault", "'stragler'"]),
        ("", ["unknown fault"]),
        ("straggler:rank=2", ["straggler needs slowdown"]),
        ("straggler:slowdown=2", ["straggler needs rank"]),
        ("hang:rank=1", ["hang needs at"]),
        ("spike:", ["spike needs at, scale"]),
        ("nan", ["nan needs at"]),
        ("data-skew:from=3", ["data-skew needs cv"]),
        ("straggler:rank=two,slowdown=1.3", ["rank must be int", "'two'"]),
        ("hang:rank=1,at=1.5", ["at must be int", "'1.5'"]),
        ("spike:at=120,scale=big", ["scale must be float", "'big'"]),
        ("thermal:rank=3,from=", ["from must be int", "''"]),
        ("nan:at=150,rank=2", ["nan takes at", "'rank=2'"]),
        ("straggler:rank=2,slowdown=1.3,form=40", ["straggler takes rank, slowdown, from, to", "'form=40'"]),
        ("slow-link:rank=5,factor", ["slow-link takes", "'factor'"]),
    ],
)
def test_malformed_specs(spec, words):
    with pytest.raises(ValueError) as e:
        parse(spec)
    message = str(e.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    if spec:
        assert repr(spec) in message  # the whole spec, to find it on a long command line


def test_trainer_arguments_accept_what_it_injects():
    from trainer.train import arguments

    args = arguments(
        [
            "--steps",
            "5",
            "--inject",
            "straggler:rank=1,slowdown=2,from=4",
            "--inject",
            "nan:at=3",
            "--inject",
            "hang:rank=0,at=2,seconds=1",
            "--inject",
            "spike:at=1,scale=8",
            "--inject",
            "slow-link:rank=1,factor=2",
        ]
    )
    assert [f.kind for f in args.faults] == ["straggler", "nan", "hang", "spike", "slow-link"]


def test_trainer_crashes_on_the_first_attempt_only(monkeypatch):
    from trainer.train import arguments

    assert [f.kind for f in arguments(["--inject", "crash:rank=1,at=5"]).faults] == ["crash"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's restart: it resumes instead
    assert arguments(["--inject", "crash:rank=1,at=5"]).faults == []


@pytest.mark.parametrize("spec", ["thermal:rank=0", "slow-node:node=0,slowdown=1.2", "data-skew:cv=0.3"])
def test_trainer_arguments_refuse_simulator_faults(spec, capsys):
    from trainer.train import arguments

    with pytest.raises(SystemExit) as e:
        arguments(["--inject", spec])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert spec.split(":")[0] in err and "`rankwatch simulate`" in err, err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--inject", "slow-stage:stage=1,slowdown=1.2"], ["1 pipeline stage(s)"]),
        (["--pp", "2", "--inject", "slow-stage:stage=2,slowdown=1.2"], ["2 pipeline stage(s)"]),
        (["--tp", "2", "--inject", "slow-link:rank=1,factor=2"], ["group=tp"]),
        (["--inject", "slow-link:rank=1,factor=2,group=tp"], ["no group="]),
        (["--dp", "1", "--inject", "slow-link:rank=0,factor=2,group=tp"], ["--tp 2 or more"]),
        (["--inject", "slow-link:rank=1,factor=2,group=pp"], ["group must be one of tp"]),
        (["--tp", "3"], ["--tp 3 x --pp 1 = 3 ranks do not divide the job's 2"]),
        (["--dp", "2", "--pp", "2"], ["--dp 2 x --tp 1 x --pp 2 = 4 ranks, but the job has 2"]),
    ],
)
def test_trainer_arguments_refuse_what_the_layout_cannot_inject(argv, words, capsys, monkeypatch):
    """A fault the job's layout has no place for (a stage it lacks, a tensor-parallel link without
    tensor parallelism) and a layout that is not the world's size are refused, in one line."""
    from trainer.train import arguments

    monkeypatch.setenv("WORLD_SIZE", "2" if {"--pp", "--tp"} & set(argv) else "1")
    with pytest.raises(SystemExit) as e:
        arguments(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    for word in words:
        assert word in err, err


def test_trainer_arguments_accept_a_3d_layout_and_its_faults(monkeypatch):
    from trainer.layout import Layout
    from trainer.train import arguments

    monkeypatch.setenv("WORLD_SIZE", "8")
    args = arguments(
        [
            "--tp",
            "2",
            "--pp",
            "2",
            "--inject",
            "slow-stage:stage=1,slowdown=2",
            "--inject",
            "slow-link:rank=3,factor=3,group=tp",
        ]
    )
    assert args.layout == Layout(dp=2, tp=2, pp=2)
    assert [(f.kind, f.get("group")) for f in args.faults] == [("slow-stage", None), ("slow-link", "tp")]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("bogus:x=1", ["unknown fault 'bogus'"]),
        ("straggler:rank=2", ["straggler needs slowdown"]),
        ("nan:at=soon", ["at must be int"]),
    ],
)
def test_train_cli_bad_spec(spec, words):
    """Refused by `rankwatch train` itself, before any rank starts."""
    r = rankwatch_cli(
        "train",
        "--nproc",
        "2",
        "--steps",
        "3",
        "--inject",
        spec,
        "--collector",
        f"http://127.0.0.1:{free_port()}",
        env={"RANKWATCH_TOKEN": "test-token-0123456"},
    )
    assert r.returncode == 2, r
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("rankwatch: error: ")
    for word in words:
        assert word in lines[0]


@pytest.fixture(scope="module")
def thermal_through_torchrun() -> subprocess.CompletedProcess:
    """`rankwatch train --inject thermal:rank=0`: a valid spec that only the simulator injects."""
    return rankwatch_cli(
        "train",
        "--nproc",
        "2",
        "--steps",
        "3",
        "--inject",
        "thermal:rank=0",
        "--collector",
        f"http://127.0.0.1:{free_port()}",
        env={"RANKWATCH_TOKEN": "test-token-0123456"},
    )


def test_train_cli_refuses_simulator_fault(thermal_through_torchrun):
    r = thermal_through_torchrun
    assert r.returncode != 0
    assert "thermal" in r.stderr and "`rankwatch simulate`" in r.stderr, r.stderr
    assert "step " not in r.stdout  # no training step ran


def test_train_cli_simulator_fault_is_a_one_line_usage_error(thermal_through_torchrun):
    """Bad input to a command gets a one-line message and exit 2. The spec is valid grammar, but the trainer
    cannot inject it: `rankwatch train` should say so itself, not leave it to each rank under torchrun
    (two argparse usage blocks and torchrun's ChildFailedError traceback, exit status 1)."""
    r = thermal_through_torchrun
    assert (r.returncode, len(r.stderr.splitlines())) == (2, 1), (
        f"exit {r.returncode}, {len(r.stderr.splitlines())} lines of stderr:\n{r.stderr[-1500:]}"
    )
    assert r.stderr.startswith("rankwatch: error: ") and "rankwatch simulate" in r.stderr
