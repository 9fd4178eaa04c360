"""`poros` command line: one module per subcommand, each with real example calls in its epilog."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import re
import sys
import warnings

from poros.engine.parallel.launch import launched
from poros.cli.streams import console_streams
from poros.errors import PorosError, WriteError
from poros.harness import preflight as checks
from poros.harness.matrix import load_matrix
from poros.settings import check_values
from poros.sizes import is_auto

SUBCOMMANDS = ("env", "plan", "parity", "bench", "report", "validate", "build", "train", "export", "generate",
               "docs")

# Third-party notices that read like failures to a new user but change nothing Poros does; the
# command line hides them (`poros bench` keeps pytest's warning summary in its log).
QUIET_WARNINGS = (  # (category, module the warning is attributed to)
    (FutureWarning, r"transformers(\.|$)"),  # e.g. `is_gradient_checkpointing` is deprecated (peft calls it)
    (DeprecationWarning, r"torch\.jit(\.|$)"),  # `torch.jit.script_method` is deprecated (bitsandbytes)
)
QUIET_LOGS = (  # (logger, text of the record)
    # bitsandbytes' CPU backend, when the optional `kernels` package is absent: it falls back to its own
    # gemm, which is what Poros's parity is measured on anyway
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
)


class Parser(argparse.ArgumentParser):
    """Keeps each epilog's example lines as written; subcommand parsers inherit the class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)


def _version() -> str:
    try:
        return importlib.metadata.version("poros")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="poros",
        description="QLoRA with blockwise residency: benchmark and validate bitwise parity.",
    )
    parser.add_argument("--version", action="version", version=f"poros {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"poros.cli.{name}").add_parser(sub)
    return parser


class _Hide(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet() -> None:
    """Hide the known third-party notices listed above (and only those)."""
    for category, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", category=category, module=module)
    for name, text in QUIET_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Hide) and f.text == text for f in logger.filters):
            logger.addFilter(_Hide(text))


def preflight(args) -> None:
    """Checks the subcommands share, made before any work: the device they name, and the model's
    limits against the sequence length they would train at."""

    device = getattr(args, "device", None)
    # a plan is made from shapes alone, for any device; only `--vram-budget auto` reads the device
    planning = args.command == "plan" and not is_auto(getattr(args, "vram_budget", None))
    if device is not None and not planning:
        checks.check_device(device, "--device")
    model, seq_len = getattr(args, "model", None), getattr(args, "seq_len", None)
    if model and isinstance(seq_len, int) and seq_len > 0:
        rank = getattr(args, "lora_rank", None)
        if rank is not None and check_values({"lora_rank": rank})[1]:
            rank = None  # not a rank at all: the settings' own check says so
        problems = checks.model_problems([model], seq_len, rank, getattr(args, "lora_targets", None))
        if problems:
            raise PorosError("; ".join(problems))


def wants_determinism(args) -> bool:
    """Whether the command will train with `deterministic`: its flag, or the matrix file it runs."""
    if getattr(args, "deterministic", None):
        return True
    if args.command == "bench" and getattr(args, "file", None):

        try:
            return bool(load_matrix(args.file).deterministic)
        except Exception:  # not a readable matrix: the bench's own checks say why, in one line
            return False
    return False


RANKED = ("parity", "train")  # commands that run as one rank of several under torchrun


def main(argv: list[str] | None = None) -> int:
    """The command line: one subcommand, its status returned; standard output and error as `console_streams`
    makes them."""
    with console_streams():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except WriteError as e:  # --help or a usage line that standard output or error could not take
        print(f"poros: error: {e}", file=sys.stderr)
        return 2
    quiet()
    try:

        if launched() and args.command not in RANKED:
            raise PorosError(f"runs as one process, not under torchrun: data-parallel runs are `torchrun ... poros "
                             f"{' / '.join(RANKED)}`, or a matrix's `gpus: N`")
        if wants_determinism(args):
            # before any command touches CUDA: cuBLAS reads its workspace configuration once per process
            from poros.engine.methods.trainer import set_cublas_workspace

            set_cublas_workspace()
        preflight(args)
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # the last of standard output, delivered or reported here
        return code
    except PorosError as e:
        prefix = f"poros {args.command}: "  # a check that names the command itself
        print(f"{prefix}error: {str(e).removeprefix(prefix)}", file=sys.stderr)
        return 2
    except OSError as e:  # a path given on the command line: one line, no traceback
        if e.filename is None:
            raise
        print(f"poros {args.command}: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"poros {args.command}: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        why = out_of_memory(e)
        if why is None:
            raise
        print(f"poros {args.command}: error: {why}", file=sys.stderr)
        return 1


def out_of_memory(e: BaseException) -> str | None:
    """An allocation torch could not make (host or device), as one line naming what to lower; None for any other
    error. By name and text: a command that never trained imports no torch."""
    text = str(e)
    host = "can't allocate memory" in text
    if not host and type(e).__name__ != "OutOfMemoryError":
        return None
    asked = re.search(r"tried to allocate (\d+ bytes|[0-9.]+ ?[KMGT]?i?B)", text, re.IGNORECASE)
    where = "host" if host else "device"
    return (f"out of {where} memory" + (f" (an allocation of {asked.group(1)})" if asked else "") +
            "; lower --batch-size, --seq-len or --grad-accum, or use a machine with more memory")


if __name__ == "__main__":
    sys.exit(main())
