"""``bench_gpu``'s rules between its flags, checked before a GPU is touched: a combination that cannot run is an
argparse error naming the flag (here: receivers that wait through a step need the step)."""

from __future__ import annotations

import pytest

from awex_integration.benchmarks.bench_gpu_args import checked, parser


def _args(*argv: str):
    ap = parser("test")
    args = ap.parse_args(list(argv))
    checked(ap, args)
    return args


def test_waiting_receivers_need_a_step_to_wait_through(capsys):
    with pytest.raises(SystemExit):
        _args("--waiting-receivers")
    assert "--waiting-receivers: with --step-seconds" in capsys.readouterr().err
    args = _args("--waiting-receivers", "--step-seconds", "0.2")
    assert args.waiting_receivers and args.step_seconds == 0.2
    assert not _args("--step-seconds", "0.2").waiting_receivers  # every rank pauses, as before
