"""Options shared by the matrix suites (suites/) and the tests (tests/)."""


def pytest_addoption(parser):
    group = parser.getgroup("poros", "Poros matrix suites")
    group.addoption("--matrix", default="cpu", help="matrix name (matrices/NAME.yaml) or file; default: cpu")
    group.addoption("--steps", type=int, default=None, help="override the matrix's steps per pass (reduced run)")
    group.addoption("--passes", type=int, default=None, help="override the matrix's timed passes (reduced run)")
    group.addoption("--parity-steps", type=int, default=None, help="steps of the parity gate (default: the matrix's parity_steps)")
    group.addoption("--results", default="out/results.jsonl", help="results JSON Lines file cells are appended to")
    group.addoption("--resume", action="store_true",
                    help="skip cells already recorded in --results and continue unfinished ones after their last pass")
    group.addoption("--max-minutes", type=float, default=None,
                    help="stop between passes before this many minutes have passed (exit 75; --resume continues)")
