"""What the command line promises about its options (Contract 3): a flag beats its
``GPU_SIDECAR_*`` variable, and a value that must be positive is refused at start, naming both
the flag and the variable."""

from __future__ import annotations

import argparse
import json

import pytest

from sidecar import config
from tests.promise_tools import cli


def parsed(command: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, command)
    return parser.parse_args(list(argv))


A, B, C = "http://127.0.0.1:9401/api/v1/write", "http://127.0.0.1:9402/api/v1/write", \
    "http://127.0.0.1:9403/api/v1/write"

# option, kind, the flags given, the variable's value, what the flags alone give, what the
# variable alone gives
FLAG_AND_VARIABLE = [
    ("interval", "float", ["--interval", "2.5"], "7", 2.5, 7.0),
    ("pcie_peak_bytes_per_second", "float", ["--pcie-peak-bytes-per-second", "1e9"], "5e9",
     1e9, 5e9),
    ("batch_max_samples", "int", ["--batch-max-samples", "500"], "9000", 500, 9000),
    ("app_max_gpus", "int", ["--app-max-gpus", "3"], "9", 3, 9),
    ("stdout", "bool", ["--stdout"], "false", True, False),
    ("app_process_series", "bool", ["--app-process-series"], "0", True, False),
    ("remote_write_url", "repeatable URL list", ["--remote-write-url", A, "--remote-write-url", B],
     C, (A, B), (C,)),
    ("otlp_url", "repeatable URL list", ["--otlp-url", A], f"{B},{C}", (A,), (B, C)),
    ("header", "repeatable pairs", ["--header", "X-Scope-OrgID=flag"], "X-Scope-OrgID=env",
     (("X-Scope-OrgID", "flag"),), (("X-Scope-OrgID", "env"),)),
    ("pod_name", "string", ["--pod-name", "from-flag"], "from-env", "from-flag", "from-env"),
    ("log_level", "string choice", ["--log-level", "debug"], "error", "debug", "error"),
]


@pytest.mark.parametrize(("name", "kind", "flags", "variable", "from_flag", "from_variable"),
                         FLAG_AND_VARIABLE, ids=[f"{c[0]}-{c[1]}" for c in FLAG_AND_VARIABLE])
def test_a_flag_given_together_with_its_environment_variable_wins(
        name, kind, flags, variable, from_flag, from_variable):
    env = {config.OPTION_BY_NAME[name].env: variable}
    # each source alone is read, so the comparison below is between two real values
    assert getattr(config.build("run", parsed("run"), env), name) == from_variable
    assert getattr(config.build("run", parsed("run", *flags), {}), name) == from_flag
    both = config.build("run", parsed("run", *flags), env)
    assert getattr(both, name) == from_flag, f"{kind} option {name}: the variable won over the flag"


def test_the_flag_wins_over_its_variable_in_the_running_agent_too():
    done = cli("run", "--once", "--simulate", "healthy", "--output", "json",
               "--pod-name", "from-flag", env={"GPU_SIDECAR_POD_NAME": "from-env"})
    assert done.returncode == 0, done.stderr[-2000:]
    pods = {json.loads(line)["labels"].get("pod") for line in done.stdout.splitlines()
            if line.startswith("{")}
    assert pods == {"from-flag"}


POSITIVE = [
    ("pcie_peak_bytes_per_second", "--pcie-peak-bytes-per-second",
     "GPU_SIDECAR_PCIE_PEAK_BYTES_PER_SECOND"),
    ("simulate_gpus", "--simulate-gpus", "GPU_SIDECAR_SIMULATE_GPUS"),
]


@pytest.mark.parametrize("value", ["0", "-1"])
@pytest.mark.parametrize(("name", "flag", "variable"), POSITIVE, ids=[p[0] for p in POSITIVE])
@pytest.mark.parametrize("command", ["run", "probe", "diagnose"])
def test_zero_or_negative_for_an_option_that_must_be_positive_is_refused_naming_flag_and_variable(
        command, name, flag, variable, value):
    assert config.OPTION_BY_NAME[name].flag == flag and config.OPTION_BY_NAME[name].env == variable
    base = ["--simulate", "healthy"]
    for args, env in ((parsed(command, *base, f"{flag}={value}"), {}),
                      (parsed(command, *base), {variable: value})):
        with pytest.raises(config.ConfigError) as refused:
            config.build(command, args, env)
        assert flag in str(refused.value) and variable in str(refused.value), str(refused.value)
    # one just above the bound is taken, so the refusal is about the value, not the option
    ok = config.build(command, parsed(command, *base, f"{flag}=1"), {})
    assert getattr(ok, name) == 1


@pytest.mark.parametrize(("name", "flag", "variable"), POSITIVE, ids=[p[0] for p in POSITIVE])
def test_the_agent_refuses_zero_at_start_with_exit_2_and_an_error_naming_flag_and_variable(
        name, flag, variable):
    by_flag = cli("run", "--once", "--simulate", "healthy", f"{flag}=0")
    by_variable = cli("run", "--once", "--simulate", "healthy", env={variable: "0"})
    for done in (by_flag, by_variable):
        assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
        assert flag in done.stderr and variable in done.stderr, done.stderr[-2000:]
        assert done.stdout == "", "the agent sampled before refusing its configuration"
